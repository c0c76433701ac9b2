"""The per-execution replay buffer in Redis: a stream of events plus a metadata hash.

Keys of one execution share the hash tag ``{<eid>}`` so the buffer works on Redis
Cluster. Appends go through ``append.lua`` (one atomic script per batch); reads take the
events and the metadata in one transaction so a reader sees a consistent pair.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from lib.backend import Batch, Keys, is_unreachable, register, translated
from lib.errors import BufferUnavailable, NotFound
from lib.execution import indexes
from lib.execution.events import TERMINAL_STATUSES, Event
from lib.execution.indexes import Listed
from lib.execution.record import (
    AppendResult,
    Asked,
    ExecutionMeta,
    Field,
    Page,
    Script,
    Status,
    refused,
)
from lib.quota import StorageQuota, Thing, execution_member, version_member

log = logging.getLogger(__name__)

# A batch whose envelopes add up to at most this is published whole on the notify
# channel (append.lua), so a reader on another process forwards it without a read.
INLINE_BYTES = 8 * 1024

# An execution's figure in its tenant's storage ledger is set again when its footprint
# moved by 1/256 of the tenant's limit, within these bounds: what a running execution
# keeps beyond its figure stays under a step plus one batch.
QUOTA_STEP_MIN, QUOTA_STEP_MAX = 4 * 1024, 1024 * 1024
# What Redis spends on an execution's keys beyond their contents (its stream's first
# node, four keys, its listing), counted with its run state: measured ~4.4 KB for a run
# of one small transform, whose contents are ~800 bytes.
EXECUTION_OVERHEAD_BYTES = 4 * 1024

# The identity fields that say where an execution is listed (indexes.Listed).
IDENTITY = (Field.TENANT.value, Field.WORKFLOW_ID.value, Field.CREATED_AT.value)


class EventBuffer:
    """Redis-backed replay buffer: create, append (atomic, fenced, trimmed), read, tail."""

    def __init__(
        self,
        *,
        redis: Redis,
        tail_redis: Redis | None = None,
        prefix: str = "fc",
        event_limit: int = 10_000,
        budget_bytes: int = 64 * 1024 * 1024,
        retention_seconds: int = 86_400,
        active_ttl_seconds: int = 30 * 86_400,
        inline_bytes: int = INLINE_BYTES,
        quota: StorageQuota | None = None,
    ) -> None:
        self.redis = redis
        # Each tenant's storage ledger: what its executions keep is handed to it.
        self.quota = quota
        self.quota_step = 0
        if quota is not None:
            # No limit (0): counted all the same, in the coarsest steps.
            share = quota.limit_bytes // 256 if quota.limit_bytes else QUOTA_STEP_MAX
            self.quota_step = min(max(share, QUOTA_STEP_MIN), QUOTA_STEP_MAX)
        self.inline_bytes = inline_bytes
        # Blocking tail reads may use a client (a pool) of their own.
        self.tail_redis = tail_redis or redis
        self.keys = Keys(prefix)
        self.event_limit = event_limit
        self.budget_bytes = budget_bytes
        self.retention_seconds = retention_seconds
        # Unfinished executions (a pause may wait days) keep their keys this long.
        self.active_ttl_seconds = max(active_ttl_seconds, retention_seconds)
        self._start = register(redis, __package__, "start.lua")
        self._append = register(redis, __package__, "append.lua")
        self._read = register(redis, __package__, "read.lua")

    @property
    def prefix(self) -> str:
        return self.keys.prefix

    @translated
    async def create(
        self,
        execution_id: str,
        *,
        workflow_id: str,
        tenant: str,
        owner: str,
        created_at: str,
        created_ms: int,
        lease_ms: int = 15_000,
        reserved: int = 0,
        extra: Mapping[str, str] | None = None,
        state: Mapping[str, bytes] | None = None,
        listed: bool = False,
        beside: Callable[[Batch], None] | None = None,
    ) -> bool:
        """Create a new execution's metadata, owned by ``owner`` at epoch 1, with its run
        state fields ``state`` and the ids up to ``reserved`` reserved for its owner, and
        list it in its tenant's index unless ``listed`` (the caller did, ``index_in``)
        (start.lua; the lease is on Redis's clock). False, with nothing written, when it
        exists already. ``beside`` adds commands sent in the same round trip, after the
        creation (on one server, run after it; on a cluster, maybe on another node)."""
        fields: list[Any] = [
            Field.WORKFLOW_ID, workflow_id, Field.TENANT, tenant,
            Field.CREATED_AT, created_at, Field.UPDATED_AT, created_at,
        ]  # fmt: skip
        for name, value in (extra or {}).items():
            fields += [name, value]
        pairs: list[Any] = [item for pair in (state or {}).items() for item in pair]
        # Where its list row is published, as which id, the ids reserved for its owner
        # from the start; then the run state's fields.
        head: list[Any] = [
            owner, lease_ms, self.active_ttl_seconds, execution_id, self.keys.status, reserved,
        ]  # fmt: skip
        # The index is another key (another slot on a cluster): written beside it.
        # NX: the creator that lost (start.lua found the id) leaves the listing as it was.
        keys = [self.keys.meta(execution_id), self.keys.state(execution_id)]
        args = [*head, len(pairs) // 2, *pairs, *fields]
        creating = (
            self._start(keys=keys, args=args)
            if beside is None
            else self._create_beside(keys, args, beside)
        )
        if listed:
            lease_end = await creating
        else:
            listing = self._list(execution_id, tenant, workflow_id, created_ms)
            lease_end, _ = await asyncio.gather(creating, listing)
        return int(lease_end) != 0

    async def _create_beside(
        self, keys: list[str], args: list[Any], beside: Callable[[Batch], None]
    ) -> Any:
        """start.lua and the commands ``beside`` adds, in one round trip: its answer."""
        batch = Batch(self.redis)
        answer: list[Any] = []
        batch.script(self._start, keys, args, then=answer.append)
        beside(batch)
        await batch.send()
        return answer[0]

    async def _list(self, execution_id: str, tenant: str, workflow_id: str, score: float) -> None:
        """List an execution in the indexes of its creation (ZADD NX: a listing that is
        there stays as it was)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in indexes.creation_keys(self.keys, tenant, workflow_id):
                pipe.zadd(key, {execution_id: score}, nx=True)
            await pipe.execute()

    def index_in(
        self,
        batch: Batch,
        execution_id: str,
        listed: Listed,
        then: Callable[[Any], None] | None = None,
    ) -> None:
        """List an execution about to be created in the indexes of its creation
        (indexes.py), as commands of ``batch`` (a list read skips an id listed a moment
        ago that has no metadata yet); ``then`` is given the tenant index's ZADD answer
        (1: this call listed it, 0: it was listed)."""
        keys = indexes.creation_keys(self.keys, listed.tenant, listed.workflow_id)
        for number, key in enumerate(keys):
            answer = then if number == 0 else None
            batch.call("ZADD", key, "NX", listed.created_ms, execution_id, then=answer)

    @translated
    async def unlist(self, execution_id: str, listed: Listed) -> None:
        """Take back a listing ``index_in`` made for a creation that did not happen here.
        Another request may create the same (named) id and rely on this listing: so
        the id is listed back if it exists by now, and that request lists it again
        after its creation (``list_again``) should the removal come after this check."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in indexes.creation_keys(self.keys, listed.tenant, listed.workflow_id):
                pipe.zrem(key, execution_id)
            await pipe.execute()
        if await self.redis.exists(self.keys.meta(execution_id)):
            await self._list(execution_id, listed.tenant, listed.workflow_id, listed.created_ms)

    @translated
    async def list_again(self, execution_id: str, listed: Listed) -> None:
        """List a just created execution whose listing was another request's (which may
        have taken it back, ``unlist``)."""
        await self._list(execution_id, listed.tenant, listed.workflow_id, listed.created_ms)

    @translated
    async def index_again(self, execution_id: str, identity: Mapping[str, str]) -> None:
        """List a recreated execution in its indexes again (the store lost them), from
        its identity fields (``Field``)."""
        listed = Listed.of(identity)
        await self._list(execution_id, listed.tenant, listed.workflow_id, listed.created_ms)

    @translated
    async def append(
        self,
        execution_id: str,
        events: Sequence[Event],
        *,
        fence: str,
        epoch: int = 1,
        first: int | None = None,
        meta: Mapping[str, str] | None = None,
        after_drop: bool = False,
        reserve: int = 0,
        recreate: bool = False,
        checkpoint: Mapping[str, bytes] | None = None,
        identity: Mapping[str, str] | None = None,
    ) -> AppendResult:
        """Append one batch atomically (append.lua); WriteRefused if refused on purpose,
        BufferUnavailable if down. An empty batch only re-asserts the writer's ownership
        (``first`` then names the id after its last stored one). ``identity``: the
        execution's identity fields as the caller knows them (never written: a final
        status is listed in its bucket without reading them first)."""
        if first is None:
            first = events[0].id
        args: list[Any] = [
            fence,
            epoch,
            first,
            "1" if after_drop else "0",
            self.event_limit,
            self.budget_bytes,
            self.retention_seconds,
            self.active_ttl_seconds,
            reserve,
            "1" if recreate else "0",
            len(events),
            len(meta or {}),
        ]
        # The checkpoint fields the batch's events carry (after ``checkpoint``: the
        # whole checkpoint written back, when the store lost some of it).
        pairs = {**(checkpoint or {})}
        for event in events:
            pairs.update(event.checkpoint)
        args.append(len(pairs))
        # Where the script's messages go: the readers' wake-up and the live lists.
        args += [
            execution_id, self.keys.notify, self.keys.status, self.inline_bytes, self.quota_step,
        ]  # fmt: skip
        for event in events:
            args.append(event.type)
            args.append(event.json)
        for field, value in (meta or {}).items():
            args.append(field)
            args.append(value)
        for field, encoded in pairs.items():
            args.append(field)
            args.append(encoded)
        # A final status is listed in its bucket before it is stored (indexes.py).
        finishing = await self._finishing(execution_id, meta or {}, identity or {})
        try:
            result = await self._append(keys=self.keys.execution(execution_id), args=args)
        except ResponseError as exc:
            raise refused(Script.APPEND, exc, Asked(execution_id)) from exc
        if finishing is not None:
            await self._finished(execution_id, finishing)
        last, first_kept, size, count, reserved, cancel, footprint, tenant = result
        if int(footprint) >= 0 and tenant:
            paused = (meta or {}).get(Field.STATUS) == Status.PAUSED
            await self._record(execution_id, tenant.decode(), int(footprint), paused=paused)
        return AppendResult(
            int(last), int(first_kept), int(size), int(count), int(reserved), cancel == b"1"
        )

    def reserve_in(
        self,
        batch: Batch,
        tenant: str,
        execution_id: str,
        size: int,
        version: tuple[str, int] | None = None,
    ) -> None:
        """Count a new execution's run state (``size`` bytes) for its tenant, and the
        workflow ``version`` it runs (digest, bytes; it lives as long as the newest
        execution of it), as one command of ``batch`` whose answer raises ``OverQuota``
        when the tenant has no room (and nothing was counted)."""
        if self.quota is None:
            return
        things = [Thing(execution_member(execution_id), size, self._lifetime_ms())]
        if version is not None:
            digest, version_size = version
            lifetime = self.active_ttl_seconds * 1000
            things.append(Thing(version_member(digest), version_size, lifetime))
        self.quota.reserve_in(batch, tenant, things)

    async def unreserve(self, tenant: str, execution_id: str) -> None:
        """Take back what ``reserve_in`` counted for an execution that was not created."""
        if self.quota is not None:
            await self.quota.forget(tenant, execution_member(execution_id))

    def _lifetime_ms(self, *, paused: bool = False) -> int:
        """How long an execution's figure counts: as long as a finished one's keys live
        (a running one's figure is set again as it grows, and when it ends), as long as
        a paused one's keys live while it waits."""
        return (self.active_ttl_seconds if paused else self.retention_seconds) * 1000

    async def _record(
        self, execution_id: str, tenant: str, footprint: int, *, paused: bool
    ) -> None:
        """Hand an execution's footprint to its tenant's ledger, after the batch that
        changed it is stored. Never a refusal, and a failure only logged: the batch is
        stored, and the next figure (or the ledger's expiry) makes up for a lost one."""
        assert self.quota is not None
        try:
            await self.quota.record(
                tenant, execution_member(execution_id), footprint, self._lifetime_ms(paused=paused)
            )
        except BufferUnavailable as exc:
            log.warning(
                "could not count an execution's storage for its tenant",
                extra={"executionId": execution_id, "bytes": footprint, "error": str(exc)},
            )

    async def _finishing(
        self, execution_id: str, meta: Mapping[str, str], known: Mapping[str, str]
    ) -> Listed | None:
        """List an execution in the bucket of the final status ``meta`` sets (none:
        None) before the batch that sets it is stored; None also when its record is
        gone (the append fails, and the writer recreates it with its identity). Its
        identity is read from the record unless ``meta`` or ``known`` hold it (an
        execution's tenant, workflow and creation never change)."""
        status = meta.get(Field.STATUS)
        if status not in TERMINAL_STATUSES:
            return None
        fields = {**known, **meta}
        identity = {name: fields[name] for name in IDENTITY if fields.get(name)}
        if len(identity) < len(IDENTITY):
            key = self.keys.meta(execution_id)
            stored = cast(list[bytes | None], await self.redis.hmget(key, list(IDENTITY)))
            values = [value.decode() for value in stored if value is not None]
            if len(values) < len(IDENTITY):
                return None
            identity = dict(zip(IDENTITY, values, strict=True))
        listed = Listed.of(identity)
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in indexes.bucket_keys(self.keys, listed.tenant, listed.workflow_id, status):
                pipe.zadd(key, {execution_id: listed.created_ms})
            await pipe.execute()
        return listed

    async def _finished(self, execution_id: str, listed: Listed) -> None:
        """Take a finished execution out of the ``open`` bucket and sweep its indexes.
        Its final event is stored: a failure here is logged, not raised (a read drops
        the entry anyway, indexes.py)."""
        opened = indexes.bucket_keys(self.keys, listed.tenant, listed.workflow_id, indexes.OPEN)
        try:
            # One round trip for both: the sweep's sample goes with the removal.
            await indexes.sweep(
                self.redis,
                self.keys,
                indexes.creation_keys(self.keys, listed.tenant, listed.workflow_id),
                unlist=[(key, execution_id) for key in opened],
            )
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            log.warning(
                "could not take a finished execution out of the open index",
                extra={"executionId": execution_id, "error": str(exc)},
            )

    @translated
    async def meta(self, execution_id: str) -> ExecutionMeta:
        """The execution's metadata; NotFound when it does not exist (or expired)."""
        fields = cast(dict[bytes, bytes], await self.redis.hgetall(self.keys.meta(execution_id)))
        if not fields:
            raise NotFound("execution", execution_id)
        return ExecutionMeta.from_hash(execution_id, fields)

    @translated
    async def meta_and_state(self, execution_id: str) -> tuple[ExecutionMeta, dict[bytes, bytes]]:
        """The execution's metadata and its run state hash as stored, in one round trip
        (both in the execution's hash slot); NotFound when it does not exist."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.meta(execution_id))
            pipe.hgetall(self.keys.state(execution_id))
            fields, state = await pipe.execute()
        if not fields:
            raise NotFound("execution", execution_id)
        return ExecutionMeta.from_hash(execution_id, fields), state

    async def resolved(self, meta: ExecutionMeta) -> ExecutionMeta:
        """``meta`` with a large output, error or pause read from the event that holds
        it (the metadata names that event instead of copying it: see log.py)."""
        changes: dict[str, Any] = {}
        for name, key in (("output", "output"), ("error", "error"), ("pause", None)):
            value = getattr(meta, name)
            if isinstance(value, dict) and value.keys() == {"$event"}:
                page = await self.read(meta.id, after=int(value["$event"]) - 1, limit=1)
                data = page.events[0].data if page.events else {}
                changes[name] = data.get(key) if key is not None else data
        return dataclasses.replace(meta, **changes) if changes else meta

    @translated
    async def read(self, execution_id: str, *, after: int, limit: int) -> Page:
        """Up to ``limit`` retained events with ids above ``after``, plus the metadata."""
        keys = self.keys.execution(execution_id)[:3]
        entries, flat, ranges = await self._read(keys=keys, args=[after, limit])
        if not flat:
            raise NotFound("execution", execution_id)
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        return Page(
            events=[_lua_entry_event(entry) for entry in entries],
            meta=ExecutionMeta.from_hash(execution_id, fields),
            dropped=[_range(member) for member in ranges],
        )

    @translated
    async def after(self, execution_id: str, *, after: int, count: int = 1000) -> list[Event]:
        """The stored events with ids above ``after`` (at most ``count``), without waiting."""
        key = self.keys.events(execution_id)
        reply: Any = await self.redis.xrange(key, min=f"({after}-0", count=count)
        return [_entry_event(entry) for entry in reply]

    @translated
    async def recent_metas(
        self,
        tenant: str,
        *,
        limit: int,
        workflow_id: str | None = None,
        status: str | None = None,
        before: indexes.Before | None = None,
        scan_limit: int = 5_000,
    ) -> list[ExecutionMeta]:
        """A tenant's newest executions of ``workflow_id`` in ``status`` (None: any),
        listed after ``before`` (a page further back in time), read from the one index
        that lists them (indexes.py); the entries found stale leave it. ``scan_limit``
        bounds the entries read whatever they hold."""
        index, bucket = self.keys.index(tenant), None
        filtered = workflow_id is not None or status is not None
        if filtered and await indexes.complete(self.redis, self.keys, tenant):
            index = indexes.read_key(self.keys, tenant, workflow_id=workflow_id, status=status)
            bucket = indexes.bucket(status)
        found: list[ExecutionMeta] = []
        dropped: list[bytes] = []
        # create() writes the index beside start.lua, not after it: an id listed a
        # moment ago may have no metadata yet. Only an id listed long before is gone.
        listed_before = (time.time() - indexes.INDEX_GRACE_SECONDS) * 1000
        pages = indexes.newest_first(self.redis, index, scan_limit, first_page=limit, before=before)
        async for entries in pages:
            metas = await self._metas([raw_id for raw_id, _score in entries])
            for (raw_id, score), meta in zip(entries, metas, strict=True):
                if meta is None:
                    if score < listed_before:
                        dropped.append(raw_id)
                elif indexes.stale(bucket, meta.status):
                    dropped.append(raw_id)
                elif workflow_id in (None, meta.workflow_id) and status in (None, meta.status):
                    found.append(meta)
            if len(found) >= limit:
                break
        if dropped:
            await self.redis.zrem(index, *dropped)
        await indexes.sweep(self.redis, self.keys, [index])
        return found[:limit]

    async def _metas(self, raw_ids: Sequence[bytes]) -> list[ExecutionMeta | None]:
        """The metadata of each execution (None for one whose record is gone)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for raw_id in raw_ids:
                pipe.hgetall(self.keys.meta(raw_id.decode()))
            results = await pipe.execute()
        return [
            ExecutionMeta.from_hash(raw_id.decode(), fields) if fields else None
            for raw_id, fields in zip(raw_ids, results, strict=True)
        ]

    @translated
    async def last_ids(self, execution_ids: list[str]) -> list[int | None]:
        """The last stored id of each execution (None for one the store does not have)."""
        found: list[int | None] = []
        for start in range(0, len(execution_ids), 500):
            chunk = execution_ids[start : start + 500]
            async with self.redis.pipeline(transaction=False) as pipe:
                for execution_id in chunk:
                    pipe.hget(self.keys.meta(execution_id), Field.LAST_ID)
                values = await pipe.execute()
            found += [None if value is None else int(value) for value in values]
        return found

    @translated
    async def ending(self, execution_id: str) -> tuple[bool, int] | None:
        """Whether the execution finished, and its last stored id (None when the store
        does not have it): the fields an idle tail looks at every few seconds, read
        alone (the whole hash copies a pause, or an outcome, of up to 16 KiB)."""
        fields = [Field.STATUS, Field.LAST_ID, Field.WORKFLOW_ID]
        status, last_id, workflow = cast(
            list[bytes | None], await self.redis.hmget(self.keys.meta(execution_id), fields)
        )
        if status is None and last_id is None and workflow is None:
            return None
        finished = status is not None and status.decode() in TERMINAL_STATUSES
        return finished, int(last_id or 0)

    @translated
    async def exists(self, execution_id: str) -> bool:
        """True while the execution's metadata exists (it expires with retention)."""
        return bool(await self.redis.exists(self.keys.meta(execution_id)))

    async def ping(self) -> bool:
        """True when the buffer answers."""
        try:
            return bool(await self.redis.ping())
        except Exception as exc:
            if is_unreachable(exc):
                return False
            raise


def _range(member: bytes) -> tuple[int, int]:
    low, _, high = member.partition(b"-")
    return int(low), int(high)


def _lua_entry_event(entry: list[Any]) -> Event:
    """An XRANGE entry as a script returns it: [id, [field, value, …]]."""
    stream_id, fields = entry
    values = dict(zip(fields[::2], fields[1::2], strict=True))
    return Event.stored(
        id=int(stream_id.split(b"-", 1)[0]), type=values[b"t"].decode(), raw=values[b"e"]
    )


def _entry_event(entry: tuple[bytes, dict[bytes, bytes]]) -> Event:
    stream_id, fields = entry
    return Event.stored(
        id=int(stream_id.split(b"-", 1)[0]),
        type=fields[b"t"].decode(),
        raw=fields[b"e"],
    )
