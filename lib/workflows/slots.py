"""Concurrency slots per model provider, shared by every replica (``slots.lua``).

A call to a provider first takes a slot of this process (a gate of the same cap), then
a slot in Redis: a lease-based semaphore on Redis's clock. Both are shared fairly
between the tenants that wait (``CURRENT_TENANT``): each tenant's calls in arrival
order, the tenants in turn, so one tenant's backlog never holds another's one call
behind it; a tenant alone may use every slot. The holder renews its lease while the
call runs; a holder that dies stops renewing and its slot frees itself when the lease
ends. Waiters keep their place
in line by asking again within a third of a lease; one that stops asking is dropped.

Waiting polls nothing: a freed slot is an entry on the provider's ``freed`` stream, and
one task per provider and process reads it (a blocking XREAD, only while some call of
this process waits) and wakes its waiters, who then ask again in their order.

When a provider answers 429, ``pause`` makes every replica hold its calls to that
provider until the wait it asked for has passed (at most ``MAX_PAUSE_SECONDS``), so
retries do not feed a storm. A call waits out a pause of up to ``WAIT_PAUSE_SECONDS``
in line; a longer one ends the wait with ``ProviderPaused``, so the call fails visibly
(and is retried after the pause, if its budget allows) instead of hanging unseen.

**A holder that lost its slot stops**, as an owner that lost its lease does: a renewal
that finds the holder gone (its lease ended while its process stalled, and the slot went
to the next caller; or the store forgot it) is never re-added; the call is cancelled
and the ``with`` raises ``SlotLost``, for the block to fail its attempt as a retryable
error. A grant whose reply arrives later than a renewal period after it was asked for
(this process stalled meanwhile) is confirmed by a renewal before the call starts; if
the slot is gone, the caller gets back in line. After the keys come back from another
server (a restart, empty or not), no slot is granted for one lease, until every holder
the store forgot has renewed and stopped (slots.lua); each process learns the server
at start (``introduce``), so it notices the change even when its first call comes after.

A holder that cannot renew stops too, before its slot can lapse: once ``TRUST`` of a
lease has passed on its own clock since it sent its last renewal that succeeded (or
the ask that was granted), its call is stopped the same way. Redis ends that lease a
whole lease after it ran the renewal, so the holder is done before anybody else can be
granted its slot; the two clocks only have to agree on the lease's length.

**While Redis cannot be reached, a call waits**, however long that lasts (logged once
it lasts a lease): the cap holds across all replicas and calls over it wait their turn
(SPEC §2.1), and a process that cannot see the shared semaphore cannot know that it is
under the cap (the slot it held may be someone else's by now). It asks again every
tenth of a lease and goes ahead once Redis grants it a slot. (It used to go ahead under
its own process's cap after a lease of outage: a holder cut off from Redis, stopped as
it must be, then called again beside the caller granted its slot.) A cancel or a stop
ends the wait as any wait in line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

from redis.asyncio import Redis

from lib.backend import Keys, register, translated
from lib.errors import BufferUnavailable, FlowcastError
from lib.tasks import stop
from lib.tenancy import CURRENT_TENANT, FairGate

log = logging.getLogger(__name__)

_BLOCK_MS = 5_000
MAX_PAUSE_SECONDS = 900.0
WAIT_PAUSE_SECONDS = 30.0
# How much of its lease a holder trusts its slot without a renewal that succeeded: the
# rest (a renewal period) is the time its call has to stop before the lease ends.
TRUST = 2 / 3


class ProviderPaused(FlowcastError):
    """The provider asked every caller to wait longer than a call waits in line."""

    code = "provider_paused"

    def __init__(self, provider: str, seconds: float) -> None:
        super().__init__(
            f"provider {provider!r} asked every caller to wait {seconds:.0f} s (a 429)"
        )
        self.provider = provider
        self.seconds = seconds


class SlotLost(FlowcastError):
    """A holder's slot was gone when it renewed, or could not be renewed in time: its
    call was stopped."""

    code = "llm_slot_lost"

    def __init__(self, provider: str) -> None:
        super().__init__(
            f"this call's slot of provider {provider!r} lapsed or could not be renewed in "
            "time (its process stalled past the lease, the store lost it, or the store "
            "could not be reached) and may be someone else's: it was stopped"
        )
        self.provider = provider


class _Held:
    """One slot held by the body of a ``with`` that runs in ``task``."""

    def __init__(self, task: asyncio.Task[Any], provider: str) -> None:
        self.task = task
        self.provider = provider
        self.outer = task.cancelling()  # cancels asked before the body began
        self.inside = True
        self.cancels = 0  # ours, asked since the slot was found gone

    @property
    def lost(self) -> bool:
        return self.cancels > 0

    def lose(self) -> None:
        """Stop the body: its slot is gone. Once it ended, its result stands."""
        if self.inside:
            self.cancels += 1
            self.task.cancel(f"the slot of {self.provider!r} lapsed")

    def ours(self) -> bool:
        """Whether the body's cancel was only ours (then it becomes SlotLost)."""
        remaining = self.task.cancelling()
        for _ in range(self.cancels):
            remaining = self.task.uncancel()
        return remaining <= self.outer


class _Line:
    """One provider's waiters in this process and the reader that wakes them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.local = FairGate(cap)
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
        self._script = register(redis, __package__, "slots.lua")
        self._lines: dict[str, _Line] = {}
        # Per provider, the server (run id) that answered last: told to slots.lua, which
        # holds grants back when another one answers now.
        self._servers: dict[str, str] = {}
        self._closed = False

    async def close(self) -> None:
        """Stop every reader; slots held now are released by their holders."""
        self._closed = True
        readers = [line.reader for line in self._lines.values() if line.reader is not None]
        await stop(*readers)

    @contextlib.asynccontextmanager
    async def hold(self, provider: str, cap: int) -> AsyncIterator[None]:
        """Hold one of ``provider``'s ``cap`` slots for the body of the ``with``;
        ``SlotLost`` when the slot lapsed meanwhile (the body was cancelled)."""
        line = self._lines.get(provider)
        if line is None or line.cap != cap:
            line = self._lines[provider] = _Line(cap)
        task = asyncio.current_task()
        assert task is not None, "a slot is held by a task"
        tenant = CURRENT_TENANT.get() or ""
        async with line.local.entered(tenant):
            token, since = await self._take(provider, line, tenant)
            held = _Held(task, provider)
            renewing = asyncio.create_task(self._renew(token, held, since))
            try:
                yield
            except asyncio.CancelledError:
                # Our own cancel (and no other) becomes SlotLost, as asyncio.timeout does.
                if held.lost and held.ours():
                    raise SlotLost(provider) from None
                raise
            finally:
                held.inside = False
                try:
                    await stop(renewing)
                finally:
                    await self._release(provider, token)

    async def _take(self, provider: str, line: _Line, tenant: str) -> tuple[str, float]:
        """Wait for a shared slot: (its token, when (loop time) the ask that got or
        kept it was sent)."""
        loop = asyncio.get_running_loop()
        while True:
            token = secrets.token_hex(8)
            try:
                asked = await self._acquire(provider, line, token, tenant)
                if loop.time() - asked <= self._lease_ms / 3000:
                    return token, asked
                # The grant reached us later than a renewal period after we asked (this
                # process stalled): its lease may have ended and the slot gone on.
                sent = loop.time()
                renewed = await self._renewed(provider, token)
                if renewed is not False:
                    return token, sent if renewed else asked
            except BaseException:
                # Cancelled in line (or with the grant's reply on its way): give up the
                # place or the slot now, not a lease later, so the calls behind go on.
                await asyncio.shield(self._release(provider, token))
                raise
            log.warning(
                "a slot granted too late had lapsed; back in line", extra={"provider": provider}
            )

    async def introduce(self, providers: Iterable[str]) -> None:
        """Learn which server holds each provider's slots, at start: a store that comes
        back empty later is then noticed by this process's first call to it."""
        for provider in providers:
            try:
                await self._call(provider, "hello", "", 0)
            except BufferUnavailable as exc:
                log.warning(
                    "provider slots unreachable at start",
                    extra={"provider": provider, "error": str(exc)},
                )

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
    async def _call(self, provider: str, op: str, token: str, arg: int, tenant: str = "") -> Any:
        reply = await self._script(
            keys=self._keys.slots(provider),
            args=[op, token, arg, self._lease_ms, self._servers.get(provider, ""), tenant],
        )
        if op in ("acquire", "renew"):
            self._servers[provider] = _text(reply[-1])
        elif op == "hello":
            self._servers[provider] = _text(reply)
        return reply

    async def _acquire(self, provider: str, line: _Line, token: str, tenant: str) -> float:
        """Wait for a shared slot: when (loop time) the granting ask was sent. While
        Redis cannot be reached it keeps asking (see the module doc)."""
        loop = asyncio.get_running_loop()
        unreachable_since: float | None = None
        told = False
        line.waiting += 1
        try:
            while True:
                asked = line.seen
                sent = loop.time()
                try:
                    granted, wait_ms, freed, paused_ms, _server = await self._call(
                        provider, "acquire", token, line.cap, tenant
                    )
                except BufferUnavailable as exc:
                    # Waited out, however long: nobody here can tell whether a slot is
                    # free (holders elsewhere may go on calling), so nobody goes ahead.
                    unreachable_since = unreachable_since or sent
                    if not told and loop.time() - unreachable_since >= self._lease_ms / 1000:
                        told = True
                        log.warning(
                            "provider slots unreachable: calls wait until Redis answers",
                            extra={"provider": provider, "error": str(exc)},
                        )
                    await asyncio.sleep(self._lease_ms / 10_000)
                    continue
                if told:
                    log.info("provider slots reachable again", extra={"provider": provider})
                unreachable_since, told = None, False
                if int(granted):
                    return sent
                if int(paused_ms) > WAIT_PAUSE_SECONDS * 1000:
                    raise ProviderPaused(provider, int(paused_ms) / 1000)
                end = _text(freed)
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
                            async with asyncio.timeout(int(wait_ms) / 1000):
                                await line.changed.wait()
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

    async def _renew(self, token: str, held: _Held, since: float) -> None:
        """Renew the holder's lease while the body runs; stop the body once the slot is
        gone, or when no renewal sent since ``TRUST`` of a lease ago has succeeded."""
        loop = asyncio.get_running_loop()
        trust = self._lease_ms * TRUST / 1000
        # A timer, not a check after each renewal: a renewal can hang on a dead link.
        timer = loop.call_at(since + trust, self._cut_off, held, trust)
        failed = False
        try:
            # Watching ``inside``, and cancelling again while the body goes on: a cancel
            # can get lost in the Redis client on Python 3.11 (seen here: this loop,
            # cancelled, renewed on for ever, and the ``with`` that awaited it never ended).
            while held.inside:
                # After a failed renewal, try again sooner, while the slot is still trusted.
                await asyncio.sleep(self._lease_ms / (10_000 if failed else 3000))
                if held.lost:
                    held.lose()
                    continue
                if not held.inside:
                    break
                sent = loop.time()
                renewed = await self._renewed(held.provider, token)
                failed = renewed is None
                if renewed is False:
                    log.warning(
                        "a slot lapsed while held (a stall, or the store lost it): its call stops",
                        extra={"provider": held.provider},
                    )
                    held.lose()
                elif renewed and not held.lost:
                    timer.cancel()
                    timer = loop.call_at(sent + trust, self._cut_off, held, trust)
        finally:
            timer.cancel()

    @staticmethod
    def _cut_off(held: _Held, trust: float) -> None:
        if held.inside and not held.lost:
            log.warning(
                "a held slot could not be renewed in time: its call stops before the slot "
                "can lapse",
                extra={"provider": held.provider, "seconds": round(trust, 3)},
            )
            held.lose()

    async def _renewed(self, provider: str, token: str) -> bool | None:
        """Extend the holder's lease: False when it is gone, None when Redis cannot be
        reached (the call goes on while the slot is trusted: ``_renew``)."""
        try:
            held, _server = await self._call(provider, "renew", token, 0)
        except BufferUnavailable as exc:
            log.warning("slot lease not renewed", extra={"provider": provider, "error": str(exc)})
            return None
        return bool(int(held))

    async def _release(self, provider: str, token: str) -> None:
        try:
            await self._call(provider, "release", token, 0)
        except BufferUnavailable as exc:
            # The slot frees itself when its lease ends.
            log.warning("slot not released", extra={"provider": provider, "error": str(exc)})


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
