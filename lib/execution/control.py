"""Ownership of executions across processes: leases, claims, pause state, cancel notes.

The process running an execution owns it through a fencing token in the metadata
hash (append.lua refuses any other writer) and a lease it renews. Every transition of
ownership goes through claim.lua, so of many concurrent resumes exactly one wins, and
a process that takes over from a dead owner fences it out for good.

Two sorted sets name the executions to watch (``leases``: running ones by lease end;
``deadlines``: paused ones by approval deadline); a cancel for an execution owned by
another process is a message on that process's control stream, read with XREAD BLOCK.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import orjson
from redis.exceptions import ResponseError

from lib.errors import Conflict, NotFound
from lib.execution.buffer import EventBuffer, load_script, translated


@dataclass(frozen=True)
class Claim:
    """A successful claim: the execution's last stored id and the status it had."""

    last_id: int
    status_before: str
    owner: str


def now_ms() -> int:
    return int(time.time() * 1000)


def node_of(token: str) -> str:
    """The process a fencing token belongs to (tokens are ``<node>:<random>``)."""
    return token.partition(":")[0]


class Control:
    """Leases, claims, run state and control messages, on the buffer's Redis."""

    def __init__(self, *, buffer: EventBuffer, lease_seconds: float) -> None:
        self.buffer = buffer
        self.redis = buffer.redis
        self.lease_ms = int(lease_seconds * 1000)
        self._claim = self.redis.register_script(load_script("claim.lua"))
        self._renew = self.redis.register_script(load_script("renew.lua"))
        self._admit = self.redis.register_script(load_script("admit.lua"))
        prefix = buffer.prefix
        self.leases_key = f"{prefix}:leases"
        self.deadlines_key = f"{prefix}:deadlines"
        self._prefix = prefix

    def control_key(self, node: str) -> str:
        return f"{self._prefix}:control:{node}"

    @translated
    async def claim(self, execution_id: str, mode: str, token: str, *, block_id: str = "") -> Claim:
        """Move ownership as ``mode`` says (see claim.lua); Conflict when it does not apply."""
        try:
            last, status, owner = await self._claim(
                keys=[self.buffer.meta_key(execution_id)],
                args=[mode, token, now_ms(), self.lease_ms, block_id],
            )
        except ResponseError as exc:
            reason, _, detail = str(exc).partition(" ")
            if reason == "NOEXEC":
                raise NotFound("execution", execution_id) from None
            if reason == "BLOCK":
                raise Conflict(
                    "not_paused_there",
                    f"the execution is paused at {detail!r}, not at {block_id!r}",
                    status="paused",
                    pausedAt=detail,
                ) from None
            if reason == "STATUS":
                raise Conflict(
                    f"execution_{detail}",
                    f"the execution is {detail}",
                    status=detail,
                ) from None
            raise Conflict(reason.lower(), str(exc)) from None
        return Claim(int(last), status.decode(), owner.decode())

    def running_key(self, tenant: str) -> str:
        return f"{self._prefix}:running:{tenant}"

    @translated
    async def admit(self, tenant: str, execution_id: str, *, limit: int) -> bool:
        """Count the execution among its tenant's running ones, if under ``limit``."""
        now = now_ms()
        admitted = await self._admit(
            keys=[self.running_key(tenant)],
            args=[execution_id, now, now + self.lease_ms, limit],
        )
        return bool(admitted)

    @translated
    async def leave(self, tenant: str, execution_id: str) -> None:
        """The execution stopped running here (finished or paused)."""
        await self.redis.zrem(self.running_key(tenant), execution_id)

    @translated
    async def renew(self, execution_id: str, token: str, tenant: str) -> bool:
        """Extend the lease; True when a cancel was requested. Conflict when fenced."""
        until = now_ms() + self.lease_ms
        try:
            requested = await self._renew(
                keys=[self.buffer.meta_key(execution_id)], args=[token, until]
            )
        except ResponseError:
            raise Conflict("fenced", f"this process no longer owns {execution_id}") from None
        await self.redis.zadd(self.leases_key, {execution_id: until})
        await self.redis.zadd(self.running_key(tenant), {execution_id: until}, xx=True)
        return bool(requested == b"1")

    @translated
    async def hold(self, execution_id: str) -> None:
        """List a running execution under its lease, for the janitors to watch."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.leases_key, {execution_id: now_ms() + self.lease_ms})
            pipe.zrem(self.deadlines_key, execution_id)
            await pipe.execute()

    @translated
    async def release(self, execution_id: str, token: str) -> None:
        """Stop watching the lease of a run that ended or paused, if it is still ours.

        Another process may already have resumed or taken over the execution; its lease
        entry must stay. (Between the check and the removal a resume could slip in: its
        first renewal, a third of a lease later, lists it again.)
        """
        owner = cast(
            bytes | None, await self.redis.hget(self.buffer.meta_key(execution_id), "owner")
        )
        if owner is None or owner.decode() == token:
            await self.redis.zrem(self.leases_key, execution_id)

    @translated
    async def watch_deadline(self, execution_id: str, deadline_ms: int) -> None:
        """List a pause under its approval deadline, for the janitors."""
        await self.redis.zadd(self.deadlines_key, {execution_id: deadline_ms})

    @translated
    async def due(self, key: str, *, limit: int = 100) -> list[str]:
        """Executions whose lease or deadline (by ``key``) has passed."""
        found = cast(
            list[bytes],
            await self.redis.zrangebyscore(key, "-inf", now_ms(), start=0, num=limit),
        )
        return [value.decode() for value in found]

    @translated
    async def forget(self, key: str, execution_id: str) -> None:
        await self.redis.zrem(key, execution_id)

    @translated
    async def save_state(
        self, execution_id: str, fields: dict[str, Any], *, deadline_ms: int | None = None
    ) -> None:
        """Persist what a resume needs (JSON values), with the pause deadline if any."""
        encoded = {name: orjson.dumps(value) for name, value in fields.items()}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.buffer.state_key(execution_id), mapping=encoded)  # type: ignore[arg-type]
            pipe.expire(self.buffer.state_key(execution_id), self.buffer.active_ttl_seconds)
            pipe.hset(
                self.buffer.meta_key(execution_id),
                "pauseDeadline",
                "" if deadline_ms is None else str(deadline_ms),
            )
            await pipe.execute()

    @translated
    async def load_state(self, execution_id: str) -> dict[str, Any]:
        raw = cast(
            dict[bytes, bytes], await self.redis.hgetall(self.buffer.state_key(execution_id))
        )
        return {name.decode(): orjson.loads(value) for name, value in raw.items()}

    @translated
    async def send_cancel(self, node: str, execution_id: str) -> None:
        """Ask the process ``node`` to cancel an execution it runs."""
        await self.redis.xadd(
            self.control_key(node), {"cancel": execution_id}, maxlen=1000, approximate=True
        )

    @translated
    async def next_cancels(self, node: str, *, after: str, block_ms: int) -> tuple[str, list[str]]:
        """Block for cancel messages to ``node`` after stream id ``after``."""
        reply: Any = await self.buffer.tail_redis.xread(
            {self.control_key(node): after}, count=100, block=block_ms
        )
        if not reply:
            return after, []
        entries = reply[0][1]
        last = entries[-1][0].decode()
        return last, [fields[b"cancel"].decode() for _, fields in entries]

    @translated
    async def control_cursor(self, node: str) -> str:
        """The id of the newest control message for ``node`` (or "0-0")."""
        entries: Any = await self.redis.xrevrange(self.control_key(node), count=1)
        return entries[0][0].decode() if entries else "0-0"
