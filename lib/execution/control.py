"""The control streams: cancels sent to the process that runs an execution, the
hand-offs every process reads, and the queue's wake-ups (work was queued).

A cancel for an execution owned by another process is a message on that process's
control stream (its owner also learns of it with its next write or renewal); a hand-off
is announced on the ``handoffs`` stream, so another process takes it over at once.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.typing import EncodableT, FieldT

from lib.backend import Batch, translated
from lib.execution.buffer import EventBuffer

log = logging.getLogger(__name__)

# How many messages each stream keeps (approximately): enough for every reader that is
# behind by a few seconds, small enough to cost nothing.
CONTROL_MAXLEN = 1000
HANDOFFS_MAXLEN = 10_000
QUEUE_MAXLEN = 1000
# How long a process's control stream outlives its last message. Node ids are new with
# every process, so the stream of one that stopped (its last message is the ``wake`` of
# its own shutdown) or died (a cancel sent to it) would otherwise stay for good: one
# key for every process ever started (found by the queue storm, stress/queue_storm.py).
# A live process reads its stream within a blocking read; should it be behind by more
# than this, the cancel still reaches the run with its owner's next renewal, and its
# read goes on across the stream's end (a recreated stream's ids come after the cursor).
CONTROL_SECONDS = 600


class ControlStreams:
    """Sends and reads the control and hand-off messages, on the buffer's Redis."""

    def __init__(self, *, buffer: EventBuffer) -> None:
        self.redis = buffer.redis
        # The blocking read goes on the buffer's client for blocking reads (a pool of
        # its own where one is given), as the event tails do.
        self.tail_redis = buffer.tail_redis
        self.keys = buffer.keys

    @translated
    async def send_cancel(self, node: str, execution_id: str) -> None:
        """Ask the process ``node`` to cancel an execution it runs."""
        await self._to_node(node, {"cancel": execution_id})

    @translated
    async def announce_handoff(self, execution_id: str, fence: str) -> None:
        """Tell every process that ``fence`` let go of a running execution."""
        await self.redis.xadd(
            self.keys.handoffs,
            {"executionId": execution_id, "fence": fence},
            maxlen=HANDOFFS_MAXLEN,
            approximate=True,
        )

    async def announce_queued(self) -> None:
        """Tell every process that work was queued (the workers with free slots take it)."""
        batch = Batch(self.redis)
        batch.call(*self._queue_wake())
        await batch.send()

    def _queue_wake(self) -> list[Any]:
        """The command that announces queued work: an entry on the queue's wake stream."""
        return ["XADD", self.keys.queue_wake, "MAXLEN", "~", QUEUE_MAXLEN, "*", "queued", "1"]

    def announce_queued_in(self, batch: Batch) -> None:
        """``announce_queued`` as a best-effort command of ``batch``: its failure is
        logged, and fails nothing else of the batch."""

        def then(reply: Any) -> None:
            if isinstance(reply, Exception):
                log.warning("could not announce queued work", extra={"error": str(reply)})

        batch.call(*self._queue_wake(), then=then, best_effort=True)

    @translated
    async def cursors(self, node: str) -> dict[str, str]:
        """Where ``node`` starts reading its control stream, the hand-offs and the
        queue's wake-ups: after the newest message of each."""
        cursors = {}
        for key in (self.keys.control(node), self.keys.handoffs, self.keys.queue_wake):
            entries: Any = await self.redis.xrevrange(key, count=1)
            cursors[key] = entries[0][0].decode() if entries else "0-0"
        return cursors

    @translated
    async def read(
        self, cursors: dict[str, str], *, block_ms: int
    ) -> tuple[list[str], list[tuple[str, str]], bool]:
        """Block for cancels to this node, hand-offs and queue wake-ups after ``cursors``
        (advanced in place): (execution ids to cancel, (execution id, fence) handed off,
        whether work was queued)."""
        streams: Any = cursors
        reply: Any = await self.tail_redis.xread(streams, count=100, block=block_ms)
        cancels: list[str] = []
        handed: list[tuple[str, str]] = []
        queued = False
        for stream, entries in reply or []:
            key = stream.decode()
            cursors[key] = entries[-1][0].decode()
            if key == self.keys.queue_wake:
                queued = True
                continue
            for _, fields in entries:
                if key == self.keys.handoffs:
                    handed.append((fields[b"executionId"].decode(), fields[b"fence"].decode()))
                elif b"cancel" in fields:
                    cancels.append(fields[b"cancel"].decode())
        return cancels, handed, queued

    @translated
    async def wake(self, node: str) -> None:
        """End ``node``'s blocking control read now (it is stopping)."""
        await self._to_node(node, {"wake": "1"})

    async def _to_node(self, node: str, message: dict[FieldT, EncodableT]) -> None:
        """A message on ``node``'s control stream, which ends CONTROL_SECONDS after it."""
        key = self.keys.control(node)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(key, message, maxlen=CONTROL_MAXLEN, approximate=True)
            pipe.expire(key, CONTROL_SECONDS)
            await pipe.execute()
