"""The per-execution replay buffer in Redis: a stream of events plus a metadata hash.

Keys of one execution share the hash tag ``{<eid>}`` so the buffer works on Redis
Cluster. Appends go through ``append.lua`` (one atomic script per batch); reads take the
events and the metadata in one transaction so a reader sees a consistent pair.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from lib.backend import Batch, Keys, is_unreachable, register, translated
from lib.errors import NotFound
from lib.execution.events import Event
from lib.execution.record import TERMINAL, Asked, Field, Script, refused

# A batch whose envelopes add up to at most this is published whole on the notify
# channel (append.lua), so a reader on another process forwards it without a read.
INLINE_BYTES = 8 * 1024

# How long after an execution is listed in its tenant's index a list read may find no
# metadata for it without taking it for expired (see recent_metas); above any clock
# skew between the replicas that write the index and read it.
INDEX_GRACE_SECONDS = 600


@dataclass(frozen=True)
class ExecutionMeta:
    """What the buffer knows about one execution, as stored in its metadata hash."""

    id: str
    workflow_id: str
    status: str
    created_at: str
    updated_at: str
    last_id: int
    first_id: int
    retained_bytes: int
    retained_count: int
    tenant: str
    owner: str
    epoch: int = 0
    checkpoint_bytes: int = 0  # outputs and answers its checkpoint holds inline
    recoveries: int = 0  # execution:recovered events stored
    crashes: int = 0  # deaths of an owner charged to it (blame.py)
    deaths: int = 0  # every death of an owner while it ran: a suspect once above 0
    reserved: int = 0
    inline_files: bool = False
    cancel_requested: bool = False
    output: Any = None
    error: Any = None
    pause: Any = None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_hash(cls, execution_id: str, fields: Mapping[bytes, bytes]) -> ExecutionMeta:
        def text(name: Field, default: str = "") -> str:
            value = fields.get(name.encode())
            return value.decode() if value is not None else default

        def number(name: Field) -> int:
            return int(text(name, "0") or 0)

        def loaded(name: Field) -> Any:
            value = fields.get(name.encode())
            return orjson.loads(value) if value else None

        return cls(
            id=execution_id,
            workflow_id=text(Field.WORKFLOW_ID),
            status=text(Field.STATUS),
            created_at=text(Field.CREATED_AT),
            updated_at=text(Field.UPDATED_AT),
            last_id=number(Field.LAST_ID),
            first_id=number(Field.FIRST_ID),
            retained_bytes=number(Field.BYTES),
            retained_count=number(Field.COUNT),
            tenant=text(Field.TENANT),
            owner=text(Field.OWNER),
            epoch=number(Field.EPOCH),
            checkpoint_bytes=number(Field.CHECKPOINT_BYTES),
            recoveries=number(Field.RECOVERIES),
            crashes=number(Field.CRASHES),
            deaths=number(Field.DEATHS),
            reserved=number(Field.RESERVED),
            inline_files=text(Field.INLINE_FILES) == "1",
            cancel_requested=text(Field.CANCEL_REQUESTED) == "1",
            output=loaded(Field.OUTPUT),
            error=loaded(Field.ERROR),
            pause=loaded(Field.PAUSE),
        )


@dataclass(frozen=True)
class AppendResult:
    last_id: int
    first_id: int
    retained_bytes: int
    retained_count: int
    reserved: int = 0
    cancel_requested: bool = False


@dataclass(frozen=True)
class Page:
    """Events after a cursor, with the metadata and dropped ranges read atomically."""

    events: list[Event]
    meta: ExecutionMeta
    dropped: list[tuple[int, int]]

    def gap_reason(self, after: int, before: int) -> str:
        """Why ids between ``after`` and ``before`` (both excluded) are not retained.

        The ring evicts only below the first retained id; any other hole was dropped,
        whether its range is recorded yet or still only known to the writer.
        """
        for low, high in self.dropped:
            if low < before and high > after:
                return "dropped"
        if self.meta.first_id and after + 1 < self.meta.first_id:
            return "evicted"
        return "dropped"


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
    ) -> None:
        self.redis = redis
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
    ) -> bool:
        """Create a new execution's metadata, owned by ``owner`` at epoch 1, with its run
        state fields ``state`` and the ids up to ``reserved`` reserved for its owner, and
        list it in its tenant's index unless ``listed`` (the caller did, ``index_in``)
        (start.lua; the lease is on Redis's clock). False, with nothing written, when it
        exists already."""
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
        creating = self._start(
            keys=[self.keys.meta(execution_id), self.keys.state(execution_id)],
            args=[*head, len(pairs) // 2, *pairs, *fields],
        )
        if listed:
            lease_end = await creating
        else:
            lease_end, _ = await asyncio.gather(
                creating,
                self.redis.zadd(self.keys.index(tenant), {execution_id: created_ms}, nx=True),
            )
        return int(lease_end) != 0

    def index_in(
        self,
        batch: Batch,
        execution_id: str,
        tenant: str,
        created_ms: int,
        then: Callable[[Any], None] | None = None,
    ) -> None:
        """List an execution about to be created in its tenant's index, as one command of
        ``batch`` (a list read skips an id listed a moment ago that has no metadata yet);
        ``then`` is given ZADD's answer (1: this call listed it, 0: it was listed)."""
        batch.call("ZADD", self.keys.index(tenant), "NX", created_ms, execution_id, then=then)

    @translated
    async def unlist(self, execution_id: str, tenant: str, created_ms: int) -> None:
        """Take back a listing ``index_in`` made for a creation that did not happen here.
        Another request may create the same (named) id and rely on this listing: so
        the id is listed back if it exists by now, and that request lists it again
        after its creation (``list_again``) should the removal come after this check."""
        index = self.keys.index(tenant)
        await self.redis.zrem(index, execution_id)
        if await self.redis.exists(self.keys.meta(execution_id)):
            await self.redis.zadd(index, {execution_id: created_ms}, nx=True)

    @translated
    async def list_again(self, execution_id: str, tenant: str, created_ms: int) -> None:
        """List a just created execution whose listing was another request's (which may
        have taken it back, ``unlist``)."""
        await self.redis.zadd(self.keys.index(tenant), {execution_id: created_ms}, nx=True)

    @translated
    async def index_again(self, execution_id: str, tenant: str) -> None:
        """List a recreated execution in its tenant's index again (the store lost it)."""
        await self.redis.zadd(self.keys.index(tenant), {execution_id: int(time.time() * 1000)})

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
    ) -> AppendResult:
        """Append one batch atomically (append.lua); WriteRefused if refused on purpose,
        BufferUnavailable if down. An empty batch only re-asserts the writer's ownership
        (``first`` then names the id after its last stored one)."""
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
        args += [execution_id, self.keys.notify, self.keys.status, self.inline_bytes]
        for event in events:
            args.append(event.type)
            args.append(event.json)
        for field, value in (meta or {}).items():
            args.append(field)
            args.append(value)
        for field, encoded in pairs.items():
            args.append(field)
            args.append(encoded)
        try:
            result = await self._append(keys=self.keys.execution(execution_id), args=args)
        except ResponseError as exc:
            raise refused(Script.APPEND, exc, Asked(execution_id)) from exc
        last, first_kept, size, count, reserved, cancel = result
        return AppendResult(
            int(last), int(first_kept), int(size), int(count), int(reserved), cancel == b"1"
        )

    @translated
    async def meta(self, execution_id: str) -> ExecutionMeta:
        """The execution's metadata; NotFound when it does not exist (or expired)."""
        fields = cast(dict[bytes, bytes], await self.redis.hgetall(self.keys.meta(execution_id)))
        if not fields:
            raise NotFound("execution", execution_id)
        return ExecutionMeta.from_hash(execution_id, fields)

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
        keep: Callable[[ExecutionMeta], bool] = lambda _meta: True,
        scan_limit: int = 5_000,
    ) -> list[ExecutionMeta]:
        """A tenant's newest executions that ``keep`` accepts; expired ones leave the index.

        The index is read in pages by score (its creation time), each page below the
        last one read, not by offset: starts that list new executions at the top (or
        listings taken back) between two pages would shift an offset, and the list would
        name an execution twice (a live list's client then kept the older copy) or skip
        one. An id a page names again (listed anew at the same millisecond) is skipped.
        """
        found: list[ExecutionMeta] = []
        expired: list[bytes] = []
        seen: set[bytes] = set()
        index = self.keys.index(tenant)
        # create() writes the index beside start.lua, not after it: an id listed a
        # moment ago may have no metadata yet. Only an id listed long before is gone.
        listed_before = (time.time() - INDEX_GRACE_SECONDS) * 1000
        top: float | str = "+inf"
        at_top = 0  # entries of the last page with the score ``top``: the next page skips them
        scanned = 0
        while len(found) < limit and scanned < scan_limit:
            entries = cast(
                list[tuple[bytes, float]],
                await self.redis.zrevrangebyscore(
                    index, top, "-inf", start=at_top, num=200, withscores=True
                ),
            )
            if not entries:
                break
            scanned += len(entries)
            lowest = entries[-1][1]
            ties = sum(1 for _raw_id, score in entries if score == lowest)
            at_top = ties + (at_top if lowest == top else 0)
            top = lowest
            fresh = [(raw_id, score) for raw_id, score in entries if raw_id not in seen]
            seen.update(raw_id for raw_id, _score in fresh)
            async with self.redis.pipeline(transaction=False) as pipe:
                for raw_id, _score in fresh:
                    pipe.hgetall(self.keys.meta(raw_id.decode()))
                results = await pipe.execute()
            for (raw_id, score), fields in zip(fresh, results, strict=True):
                if not fields:
                    if score < listed_before:
                        expired.append(raw_id)
                    continue
                meta = ExecutionMeta.from_hash(raw_id.decode(), fields)
                if keep(meta):
                    found.append(meta)
                    if len(found) == limit:
                        break
        if expired:
            await self.redis.zrem(index, *expired)
        return found

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
