"""Concurrency slots per model provider, shared by every replica (``slots.lua``).

A call to a provider first takes a slot of this process (an ``asyncio.Semaphore`` of
the same cap), then a slot in Redis: a lease-based, first-come-first-served semaphore
on Redis's clock. The holder renews its lease while the call runs; a holder that dies
stops renewing and its slot frees itself when the lease ends. Waiters keep their place
in line by asking again within a third of a lease; one that stops asking is dropped.

Waiting polls nothing: a freed slot is an entry on the provider's ``freed`` stream, and
one task per provider and process reads it (a blocking XREAD, only while some call of
this process waits) and wakes its waiters, who then ask again in their order.

When a provider answers 429, ``pause`` makes every replica hold its calls to that
provider until the wait it asked for has passed (at most ``MAX_PAUSE_SECONDS``), so
retries do not feed a storm. A call waits out a pause of up to ``WAIT_PAUSE_SECONDS``
in line; a longer one ends the wait with ``ProviderPaused``, so the call fails visibly
(and is retried after the pause, if its budget allows) instead of hanging unseen.

If Redis cannot be reached, calls go ahead under this process's own cap (logged): a
buffer outage never stalls the work (SPEC §5), at the cost of the cross-replica cap
for as long as it lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any, cast

from redis.asyncio import Redis

from lib.backend import Keys, load_script, translated
from lib.errors import BufferUnavailable, FlowcastError

log = logging.getLogger(__name__)

_BLOCK_MS = 5_000
MAX_PAUSE_SECONDS = 900.0
WAIT_PAUSE_SECONDS = 30.0


class ProviderPaused(FlowcastError):
    """The provider asked every caller to wait longer than a call waits in line."""

    code = "provider_paused"

    def __init__(self, provider: str, seconds: float) -> None:
        super().__init__(
            f"provider {provider!r} asked every caller to wait {seconds:.0f} s (a 429)"
        )
        self.provider = provider
        self.seconds = seconds


class _Line:
    """One provider's waiters in this process and the reader that wakes them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.local = asyncio.Semaphore(cap)
        self.changed = asyncio.Condition()
        self.seen = "0-0"  # the last freed entry the reader has read
        self.waiting = 0
        self.reader: asyncio.Task[None] | None = None


class Slots:
    """Cross-replica concurrency caps, one per provider name."""

    def __init__(
        self, *, redis: Redis, tail_redis: Redis, prefix: str = "fc", lease_seconds: float = 15.0
    ) -> None:
        self._redis = redis
        self._tail = tail_redis
        self._keys = Keys(prefix)
        self._lease_ms = max(int(lease_seconds * 1000), 300)
        self._script = redis.register_script(load_script(__package__, "slots.lua"))
        self._lines: dict[str, _Line] = {}
        self._closed = False

    async def close(self) -> None:
        """Stop every reader; slots held now are released by their holders."""
        self._closed = True
        readers = [line.reader for line in self._lines.values() if line.reader is not None]
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def hold(self, provider: str, cap: int) -> AsyncIterator[None]:
        """Hold one of ``provider``'s ``cap`` slots for the body of the ``with``."""
        line = self._lines.get(provider)
        if line is None or line.cap != cap:
            line = self._lines[provider] = _Line(cap)
        token = secrets.token_hex(8)
        async with line.local:
            try:
                shared = await self._acquire(provider, line, token)
            except BaseException:
                # Cancelled in line (or with the grant's reply on its way): give up the
                # place or the slot now, not a lease later, so the calls behind go on.
                await asyncio.shield(self._release(provider, token))
                raise
            renewing = asyncio.create_task(self._renew(provider, token)) if shared else None
            try:
                yield
            finally:
                if renewing is not None:
                    renewing.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await renewing
                if shared:
                    await self._release(provider, token)

    async def pause(self, provider: str, seconds: float) -> None:
        """Hold every replica's next calls to ``provider`` for ``seconds`` (a 429's ask)."""
        seconds = min(seconds, MAX_PAUSE_SECONDS)
        try:
            await self._call(provider, "pause", "", max(int(seconds * 1000), 1))
        except BufferUnavailable as exc:
            log.warning(
                "provider pause not shared", extra={"provider": provider, "error": str(exc)}
            )

    @translated
    async def _call(self, provider: str, op: str, token: str, arg: int) -> Any:
        return await self._script(
            keys=self._keys.slots(provider), args=[op, token, arg, self._lease_ms]
        )

    async def _acquire(self, provider: str, line: _Line, token: str) -> bool:
        """Wait for a shared slot; False when Redis is unreachable (local cap only)."""
        line.waiting += 1
        try:
            while True:
                asked = line.seen
                try:
                    granted, wait_ms, freed, paused_ms = await self._call(
                        provider, "acquire", token, line.cap
                    )
                except BufferUnavailable as exc:
                    log.warning(
                        "provider slots unreachable: this process's cap only",
                        extra={"provider": provider, "error": str(exc)},
                    )
                    return False
                if int(granted):
                    return True
                if int(paused_ms) > WAIT_PAUSE_SECONDS * 1000:
                    raise ProviderPaused(provider, int(paused_ms) / 1000)
                end = freed.decode() if isinstance(freed, bytes) else str(freed)
                async with line.changed:
                    if line.reader is None:
                        # Start where the script saw the stream end, even before ``seen``:
                        # a stream that expired (or was lost) begins again from "0-0".
                        line.seen = asked = end
                        line.reader = asyncio.create_task(self._read(provider, line))
                    # The reader has read an entry since we asked: maybe a slot freed
                    # after the script looked, so ask again at once. (Comparing ids
                    # instead would spin for as long as a lost stream stays behind them.)
                    if line.seen == asked:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(line.changed.wait(), int(wait_ms) / 1000)
        finally:
            line.waiting -= 1

    async def _read(self, provider: str, line: _Line) -> None:
        """Wake this process's waiters on every freed slot; ends when none waits."""
        stream = self._keys.slots(provider)[4]
        while True:
            async with line.changed:
                if line.waiting == 0 or self._closed:
                    line.reader = None  # under the lock: a new waiter starts a new reader
                    return
                cursor = line.seen
            try:
                found = await self._tail.xread({stream: cursor}, block=_BLOCK_MS, count=64)
            except Exception as exc:  # an outage: waiters ask again on their own timer
                log.warning(
                    "freed-slot reader failed", extra={"provider": provider, "error": str(exc)}
                )
                await asyncio.sleep(self._lease_ms / 3000)
                continue
            if found:
                entries = cast(list[tuple[bytes, Any]], cast(list[Any], found)[0][1])
                async with line.changed:
                    line.seen = entries[-1][0].decode()
                    line.changed.notify_all()

    async def _renew(self, provider: str, token: str) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            try:
                await self._call(provider, "renew", token, 0)
            except BufferUnavailable as exc:
                log.warning(
                    "slot lease not renewed", extra={"provider": provider, "error": str(exc)}
                )

    async def _release(self, provider: str, token: str) -> None:
        try:
            await self._call(provider, "release", token, 0)
        except BufferUnavailable as exc:
            # The slot frees itself when its lease ends.
            log.warning("slot not released", extra={"provider": provider, "error": str(exc)})
