"""The per-execution replay buffer in Redis: a stream of events plus a metadata hash.

Keys of one execution share the hash tag ``{<eid>}`` so the buffer works on Redis
Cluster. Appends go through ``append.lua`` (one atomic script per batch); reads take the
events and the metadata in one transaction so a reader sees a consistent pair.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from lib.errors import BufferUnavailable, FlowcastError, NotFound, WriteRefused
from lib.execution.events import TERMINAL_STATUSES, Event

INDEX_KEY = "executions"


P = ParamSpec("P")
T = TypeVar("T")


def translated(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Turn Redis client errors into BufferUnavailable at the buffer's boundary."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except ResponseError as exc:
            raise BufferUnavailable(f"the buffer refused the command: {exc}") from exc
        # RedisClusterException is not a RedisError: the cluster client raises it when
        # no node answers or a slot has no node, and it must not escape the buffer.
        except (RedisError, RedisClusterException, OSError) as exc:
            raise BufferUnavailable(f"the buffer is unreachable: {exc}") from exc

    return wrapper


def load_script(name: str) -> str:
    return importlib.resources.files("lib.execution").joinpath(name).read_text()


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
    cancel_requested: bool = False
    output: Any = None
    error: Any = None
    pause: Any = None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @classmethod
    def from_hash(cls, execution_id: str, fields: Mapping[bytes, bytes]) -> ExecutionMeta:
        def text(name: str, default: str = "") -> str:
            value = fields.get(name.encode())
            return value.decode() if value is not None else default

        def number(name: str) -> int:
            return int(text(name, "0") or 0)

        def loaded(name: str) -> Any:
            value = fields.get(name.encode())
            return orjson.loads(value) if value else None

        return cls(
            id=execution_id,
            workflow_id=text("workflowId"),
            status=text("status"),
            created_at=text("createdAt"),
            updated_at=text("updatedAt"),
            last_id=number("lastId"),
            first_id=number("firstId"),
            retained_bytes=number("bytes"),
            retained_count=number("count"),
            tenant=text("tenant"),
            owner=text("owner"),
            cancel_requested=text("cancelRequested") == "1",
            output=loaded("output"),
            error=loaded("error"),
            pause=loaded("pause"),
        )


@dataclass(frozen=True)
class AppendResult:
    last_id: int
    first_id: int
    retained_bytes: int
    retained_count: int


@dataclass(frozen=True)
class Page:
    """Events after a cursor, with the metadata and dropped ranges read atomically."""

    events: list[Event]
    meta: ExecutionMeta
    dropped: list[tuple[int, int]]

    def gap_reason(self, after: int, before: int) -> str:
        """Why ids between ``after`` and ``before`` (both excluded) are not retained."""
        for low, high in self.dropped:
            if low < before and high > after:
                return "dropped"
        return "evicted"


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
    ) -> None:
        self.redis = redis
        # Blocking tail reads may use a client (a pool) of their own.
        self.tail_redis = tail_redis or redis
        self.prefix = prefix
        self.event_limit = event_limit
        self.budget_bytes = budget_bytes
        self.retention_seconds = retention_seconds
        # Unfinished executions (a pause may wait days) keep their keys this long.
        self.active_ttl_seconds = max(active_ttl_seconds, retention_seconds)
        self._append = redis.register_script(load_script("append.lua"))
        self._read = redis.register_script(load_script("read.lua"))

    def stream_key(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:events"

    def meta_key(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:meta"

    def dropped_key(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:dropped"

    def keys(self, execution_id: str) -> list[str]:
        """The keys of one execution, in the order the scripts take them."""
        return [
            self.stream_key(execution_id),
            self.meta_key(execution_id),
            self.dropped_key(execution_id),
            self.state_key(execution_id),
        ]

    def state_key(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:state"

    def index_key(self, tenant: str) -> str:
        return f"{self.prefix}:{INDEX_KEY}:{tenant}"

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
        extra: Mapping[str, str] | None = None,
    ) -> None:
        """Create the metadata of a new execution and list it in its tenant's index."""
        fields: dict[Any, Any] = {
            "workflowId": workflow_id,
            "status": "running",
            "createdAt": created_at,
            "updatedAt": created_at,
            "lastId": "0",
            "firstId": "0",
            "bytes": "0",
            "count": "0",
            "tenant": tenant,
            "owner": owner,
            **(extra or {}),
        }
        # One round trip on the path to an execution's first event.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.meta_key(execution_id), mapping=fields)
            pipe.expire(self.meta_key(execution_id), self.active_ttl_seconds)
            pipe.zadd(self.index_key(tenant), {execution_id: created_ms})
            await pipe.execute()

    @translated
    async def append(
        self,
        execution_id: str,
        events: Sequence[Event],
        *,
        fence: str,
        meta: Mapping[str, str] | None = None,
        after_drop: bool = False,
    ) -> AppendResult:
        """Append one batch atomically; WriteRefused if refused, BufferUnavailable if down."""
        args: list[Any] = [
            fence,
            events[0].id,
            "1" if after_drop else "0",
            self.event_limit,
            self.budget_bytes,
            self.retention_seconds,
            self.active_ttl_seconds,
            len(events),
            len(meta or {}),
        ]
        for event in events:
            args.append(event.type)
            args.append(event.json)
        for field, value in (meta or {}).items():
            args.append(field)
            args.append(value)
        try:
            result = await self._append(keys=self.keys(execution_id), args=args)
        except ResponseError as exc:
            raise _refusal(execution_id, exc) from exc
        return AppendResult(*(int(value) for value in result))

    @translated
    async def meta(self, execution_id: str) -> ExecutionMeta:
        """The execution's metadata; NotFound when it does not exist (or expired)."""
        fields = cast(dict[bytes, bytes], await self.redis.hgetall(self.meta_key(execution_id)))
        if not fields:
            raise NotFound("execution", execution_id)
        return ExecutionMeta.from_hash(execution_id, fields)

    @translated
    async def read(self, execution_id: str, *, after: int, limit: int) -> Page:
        """Up to ``limit`` retained events with ids above ``after``, plus the metadata."""
        keys = self.keys(execution_id)[:3]
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
    async def tail(self, execution_id: str, *, after: int, block_ms: int) -> list[Event]:
        """Block until events with ids above ``after`` are stored (or ``block_ms`` passes)."""
        key = self.stream_key(execution_id)
        reply: Any = await self.tail_redis.xread({key: f"{after}-0"}, count=1000, block=block_ms)
        if not reply:
            return []
        return [_entry_event(entry) for entry in reply[0][1]]

    @translated
    async def recent_metas(
        self,
        tenant: str,
        *,
        limit: int,
        keep: Callable[[ExecutionMeta], bool] = lambda _meta: True,
        scan_limit: int = 5_000,
    ) -> list[ExecutionMeta]:
        """A tenant's newest executions that ``keep`` accepts; expired ones leave the index."""
        found: list[ExecutionMeta] = []
        expired: list[bytes] = []
        index = self.index_key(tenant)
        offset = 0
        while len(found) < limit and offset < scan_limit:
            ids = cast(list[bytes], await self.redis.zrevrange(index, offset, offset + 199))
            if not ids:
                break
            offset += len(ids)
            async with self.redis.pipeline(transaction=False) as pipe:
                for raw_id in ids:
                    pipe.hgetall(self.meta_key(raw_id.decode()))
                results = await pipe.execute()
            for raw_id, fields in zip(ids, results, strict=True):
                if not fields:
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
    async def exists(self, execution_id: str) -> bool:
        """True while the execution's metadata exists (it expires with retention)."""
        return bool(await self.redis.exists(self.meta_key(execution_id)))

    async def ping(self) -> bool:
        """True when the buffer answers."""
        try:
            return bool(await self.redis.ping())
        except (RedisError, RedisClusterException, OSError):
            return False


def _refusal(execution_id: str, exc: ResponseError) -> FlowcastError:
    reason, _, detail = str(exc).partition(" ")
    if reason == "ORDER":
        return WriteRefused(execution_id, "order", last_id=int(detail))
    if reason == "FENCED":
        return WriteRefused(execution_id, "fenced")
    if reason == "NOEXEC":
        return WriteRefused(execution_id, "gone")
    return BufferUnavailable(f"the buffer refused the append: {exc}")


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
