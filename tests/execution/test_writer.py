"""The event writer on a real Valkey server, with faults injected at the buffer seam.

``FaultyBuffer`` is the real ``EventBuffer`` with a switchboard in front of ``append``:
it can be down for a window, fail chosen batches, lose the reply of a batch it applied,
or hold a batch until released. Everything it does let through is a real Lua append,
and every assertion about what a reader sees is made by reading the real server.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from lib.errors import BufferUnavailable
from lib.execution.buffer import EventBuffer
from lib.execution.ceiling import Ceiling
from lib.execution.events import Event
from lib.execution.flush import EventWriter, batch_meta
from lib.execution.hub import Hub
from lib.execution.outage import TRANSITIONS, LiveGate, Transition, WriterState
from lib.execution.record import AppendResult, Page
from lib.execution.stream import Readers, StreamReader
from lib.execution.values import LocalValueStore
from tests.support.api import until
from tests.support.logcheck import check_log, check_view
from tests.support.sse import Frame, parse_frame
from tests.support.timing import assert_within, hold_for, oversleep

FENCE = "owner-1"

BatchTest = Callable[[Sequence[Event]], bool]


@dataclass(frozen=True)
class Attempt:
    at: float
    first: int
    last: int


class FaultyBuffer(EventBuffer):
    """The real buffer, with faults injected in front of ``append``."""

    def __init__(self, *, redis: Redis, prefix: str) -> None:
        super().__init__(redis=redis, prefix=prefix)
        self.down = False
        self.fails: BatchTest = lambda _batch: False
        self.loses_reply: BatchTest = lambda _batch: False
        self.holds: BatchTest = lambda _batch: False
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self.attempts: list[Attempt] = []

    def heal(self) -> None:
        """Clear every fault, so a writer can drain after a failed assertion."""
        self.down = False
        self.fails = self.loses_reply = self.holds = lambda _batch: False
        self.release.set()

    async def append(
        self,
        execution_id: str,
        events: Sequence[Event],
        **options: Any,
    ) -> AppendResult:
        self.attempts.append(Attempt(time.monotonic(), events[0].id, events[-1].id))
        if self.holds(events):
            self.holding.set()
            await self.release.wait()
        if self.down or self.fails(events):
            raise BufferUnavailable("injected: the buffer is unreachable")
        result = await super().append(execution_id, events, **options)
        if self.loses_reply(events):
            raise BufferUnavailable("injected: the reply was lost after the script ran")
        return result


class HeldRecords(LocalValueStore):
    """A local value store whose record writes wait until ``open`` is set (a seam)."""

    def __init__(self, *, root: Path) -> None:
        super().__init__(root=root)
        self.open = asyncio.Event()
        self.open.set()

    async def put_record(self, execution_id: str, name: str, data: bytes) -> None:
        await self.open.wait()
        await super().put_record(execution_id, name, data)


@pytest.fixture
async def faulty(redis: Redis) -> AsyncIterator[FaultyBuffer]:
    yield FaultyBuffer(redis=redis, prefix=f"w{uuid.uuid4().hex[:6]}")


async def create(buffer: EventBuffer, *, reserved: bool = False) -> str:
    execution_id = f"ex_{uuid.uuid4().hex}"
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant="t",
        owner=FENCE,
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
        reserved=1 if reserved else 0,
    )
    return execution_id


@asynccontextmanager
async def writing(
    buffer: FaultyBuffer,
    execution_id: str,
    *,
    max_pending: int = 10_000,
    retry_base_seconds: float = 0.005,
    retry_max_seconds: float = 0.05,
    hub: Hub | None = None,
) -> AsyncIterator[EventWriter]:
    """A running writer, showing its events to its run's channel on ``hub`` if given
    (the channel keeps what is shown and not stored: ``hub.unstored``); leaving the
    block waits until it has stored everything."""
    writer = EventWriter(
        buffer=buffer,
        execution_id=execution_id,
        fence=FENCE,
        max_pending=max_pending,
        retry_base_seconds=retry_base_seconds,
        retry_max_seconds=retry_max_seconds,
    )
    if hub is not None:
        writer.show_to(hub.attach_local(execution_id, last_id=0))
    async with writer:
        try:
            yield writer
        except BaseException:
            buffer.heal()  # the writer drains on exit; let it, so the failure is reported
            raise


def event(execution_id: str, event_id: int, *, last: int) -> Event:
    if event_id == 1:
        kind, data = "execution:started", {"input": None}
    elif event_id == last:
        kind, data = "execution:completed", {"output": {"n": last}, "durationMs": 1}
    else:
        kind, data = "block:chunk", {"blockId": "b", "text": f"t{event_id}"}
    return Event(id=event_id, type=kind, execution_id=execution_id, workflow_id="wf", data=data)


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition of the test's own state (the writer runs on this loop)."""
    await until(condition, "the writer's state", timeout, every=0.001)


async def read_page(buffer: EventBuffer, execution_id: str) -> Page:
    return await buffer.read(execution_id, after=0, limit=100_000)


def assert_consistent(page: Page) -> None:
    """What any reader of the stored log may see at any moment.

    Stored ids plus recorded dropped ranges cover 1..lastId; a terminal status is seen
    exactly when the terminal event is stored, and then it is the last event.
    """
    ids = [stored.id for stored in page.events]
    covered = set(ids)
    for low, high in page.dropped:
        covered.update(range(low, high + 1))
    last_id = page.meta.last_id
    assert covered >= set(range(1, last_id + 1)), (ids, page.dropped, last_id)
    assert ids == sorted(ids) and (not ids or ids[-1] == last_id), (ids, last_id)
    terminals = [stored.id for stored in page.events if stored.terminal]
    if page.meta.finished:
        assert terminals == [last_id], f"status {page.meta.status} but terminal ids {terminals}"
        assert page.events[-1].terminal
    else:
        assert terminals == [], f"terminal event stored under status {page.meta.status}"


def stored_envelopes(page: Page) -> list[dict[str, Any]]:
    return [orjson.loads(stored.json) for stored in page.events]


async def replay(buffer: EventBuffer, execution_id: str, cursor: int) -> list[Frame]:
    async with Readers(buffer=buffer) as live:
        reader = StreamReader(readers=live, execution_id=execution_id, cursor=cursor)
        data = b"".join([chunk async for chunk in reader.frames()])
    return [parse_frame(raw) for raw in data.split(b"\n\n") if raw]


async def test_terminal_status_is_never_visible_before_every_earlier_event_is_stored(
    faulty: FaultyBuffer, redis: Redis
) -> None:
    total = 200
    execution_id = await create(faulty)
    observer_buffer = EventBuffer(redis=redis, prefix=faulty.prefix)
    pending_terminal_seen = 0
    observations = 0
    finished = asyncio.Event()

    def terminal_batch_first() -> int | None:
        return next((a.first for a in faulty.attempts if a.last == total), None)

    async def observe() -> None:
        nonlocal pending_terminal_seen, observations
        while not finished.is_set():
            page = await read_page(observer_buffer, execution_id)
            assert_consistent(page)
            observations += 1
            first = terminal_batch_first()
            if page.meta.finished:
                finished.set()
            elif first is not None and page.meta.last_id == first - 1:
                pending_terminal_seen += 1
            await hold_for(0.001, "the observer's pace: many looks while the writer works")

    # The batch with the terminal event fails until a reader has seen, several times,
    # every event before that batch stored without the terminal status; then its first
    # success's reply is lost, so the writer must recognise its own batch on the retry.
    faulty.fails = lambda batch: batch[-1].terminal and pending_terminal_seen < 5
    lost: list[int] = []

    def loses_reply(batch: Sequence[Event]) -> bool:
        if batch[-1].terminal and not lost:
            lost.append(batch[-1].id)
            return True
        return False

    faulty.loses_reply = loses_reply
    observer = asyncio.create_task(observe())
    async with writing(faulty, execution_id) as writer:
        for event_id in range(1, total + 1):
            if event_id == 60:
                faulty.down = True  # an outage in the middle of the run
            if event_id == 120:
                faulty.down = False
            writer.put(event(execution_id, event_id, last=total))
            if event_id % 5 == 0 and event_id < total - 5:
                await hold_for(0.001, "the run's pace: batches of five")
    async with asyncio.timeout(10):
        await observer

    page = await read_page(faulty, execution_id)
    assert_consistent(page)
    check_log(stored_envelopes(page))
    assert page.dropped == []
    assert page.meta.status == "completed" and page.meta.output == {"n": total}
    assert pending_terminal_seen >= 5 and observations > pending_terminal_seen
    assert lost == [total]
    assert writer.refused is None and writer.dropped_events == 0
    terminal_attempts = [a for a in faulty.attempts if a.last == total]
    # At least: one failure, the try whose reply was lost, and the retry that finds it.
    assert len(terminal_attempts) >= 3
    # No batch was ever formed again: the in-flight batch is retried exactly as it was.
    assert {(a.first, a.last) for a in terminal_attempts} == {(terminal_attempts[0].first, total)}


async def test_events_put_during_an_outage_are_kept_and_all_stored_once_it_clears(
    faulty: FaultyBuffer,
) -> None:
    execution_id = await create(faulty)
    faulty.down = True
    hub = Hub()
    async with writing(faulty, execution_id, hub=hub) as writer:
        for event_id in range(1, 300):
            writer.put(event(execution_id, event_id, last=300))
            if event_id % 50 == 0:
                await hold_for(0.01, "the run's pace: batches of fifty")
        await wait_for(lambda: writer.failures >= 5)
        assert writer.pending == 299
        # Nothing was reserved before the outage: nothing is shown (SPEC §5).
        assert hub.unstored(execution_id) == [] and writer.shown_id == 0
        assert (await read_page(faulty, execution_id)).events == []
        writer.put(event(execution_id, 300, last=300))
        faulty.down = False
    page = await read_page(faulty, execution_id)
    assert_consistent(page)
    check_log(stored_envelopes(page))
    assert len(page.events) == 300 and page.dropped == []
    assert writer.pending == 0 and writer.dropped_events == 0


async def test_retries_back_off_with_jitter_instead_of_looping_hot(
    faulty: FaultyBuffer,
) -> None:
    base, cap = 0.02, 0.08
    # How late a sleeper wakes on this machine now: each wait below is as late.
    late = await oversleep(base)
    execution_id = await create(faulty)
    faulty.down = True
    async with writing(
        faulty, execution_id, retry_base_seconds=base, retry_max_seconds=cap
    ) as writer:
        writer.put(event(execution_id, 1, last=3))
        await wait_for(lambda: len(faulty.attempts) >= 20)
        window = faulty.attempts[-1].at - faulty.attempts[0].at
        writer.put(event(execution_id, 2, last=3))
        writer.put(event(execution_id, 3, last=3))
        faulty.down = False
    attempts = [a for a in faulty.attempts if a.first == 1]
    gaps = [b.at - a.at for a, b in itertools.pairwise(attempts)]
    # 19 waits of at least base/2, growing to the cap: no hot loop.
    assert window >= 19 * base / 2 * 0.9
    assert min(gaps) >= base / 2 * 0.9
    assert_within(gaps[0], probe=base + late, ratio=1.5, floor=0.005, what="the first retry's wait")
    # At the cap each wait is drawn from [cap/2, cap]; the scheduler can only make a
    # wait longer, so waits well below the cap can only come from the jitter.
    capped = gaps[4:]
    assert min(capped) < cap * 0.75 + late, (capped, late)
    assert len({round(gap, 4) for gap in capped}) > 1
    page = await read_page(faulty, execution_id)
    check_log(stored_envelopes(page))


async def test_past_max_pending_the_oldest_waiting_events_are_dropped_and_replay_reports_them(
    faulty: FaultyBuffer,
) -> None:
    total = 40
    execution_id = await create(faulty)
    faulty.down = True
    hub = Hub()
    async with writing(faulty, execution_id, max_pending=10, hub=hub) as writer:
        for event_id in range(1, 6):
            writer.put(event(execution_id, event_id, last=total))
        await wait_for(lambda: len(faulty.attempts) >= 2)
        # Events 1-5 are the batch in flight; they are retried as they are.
        for event_id in range(6, total + 1):
            writer.put(event(execution_id, event_id, last=total))
        assert writer.pending == 10
        assert hub.unstored(execution_id) == []  # no id reserved yet: none shown
        assert writer.dropped_events == 30
        faulty.down = False
    page = await read_page(faulty, execution_id)
    assert_consistent(page)
    assert [e.id for e in page.events] == [1, 2, 3, 4, 5, 36, 37, 38, 39, 40]
    assert page.dropped == [(6, 35)]
    assert page.meta.status == "completed" and page.events[-1].id == total
    assert page.gap_reason(5, 36) == "dropped"

    frames = await replay(faulty, execution_id, cursor=0)
    gaps = [frame.json for frame in frames if frame.event == "replay:gap"]
    assert gaps == [{"after": 5, "resumeAt": 36, "reason": "dropped"}]
    envelopes = check_view(frames)
    assert [e["id"] for e in envelopes] == [1, 2, 3, 4, 5, 36, 37, 38, 39, 40]
    assert envelopes[-1]["type"] == "execution:completed"
    # A cursor inside the dropped range resumes at the first kept event, with the gap.
    frames = await replay(faulty, execution_id, cursor=20)
    assert [f.json for f in frames if f.event == "replay:gap"] == [
        {"after": 20, "resumeAt": 36, "reason": "dropped"}
    ]
    assert [e["id"] for e in check_view(frames, after=20)] == [36, 37, 38, 39, 40]


async def test_the_newest_event_is_never_dropped_even_when_the_batch_in_flight_fills_the_cap(
    faulty: FaultyBuffer,
) -> None:
    execution_id = await create(faulty)
    faulty.down = True
    hub = Hub()
    async with writing(faulty, execution_id, max_pending=3, hub=hub) as writer:
        for event_id in range(1, 4):
            writer.put(event(execution_id, event_id, last=9))
        await wait_for(lambda: len(faulty.attempts) >= 1)
        # The batch in flight alone fills the cap: each new event replaces the last one
        # waiting, and the newest (here the terminal one) is always kept.
        for event_id in range(4, 10):
            writer.put(event(execution_id, event_id, last=9))
            assert hub.unstored(execution_id) == []  # no id reserved: none shown
        faulty.down = False
    page = await read_page(faulty, execution_id)
    assert_consistent(page)
    assert [e.id for e in page.events] == [1, 2, 3, 9]
    assert page.dropped == [(4, 8)]
    assert page.meta.status == "completed"


async def test_events_dropped_while_a_batch_after_a_drop_is_in_flight_are_recorded_too(
    faulty: FaultyBuffer,
) -> None:
    total = 40
    execution_id = await create(faulty)
    faulty.down = True
    hub = Hub()
    async with writing(faulty, execution_id, max_pending=10, hub=hub) as writer:
        for event_id in range(1, 4):
            writer.put(event(execution_id, event_id, last=total))
        await wait_for(lambda: len(faulty.attempts) >= 1)
        for event_id in range(4, 21):
            writer.put(event(execution_id, event_id, last=total))
        assert hub.unstored(execution_id) == []
        # The buffer comes back, but the batch that records the first drop is slow.
        faulty.holds = lambda batch: batch[0].id == 14
        faulty.down = False
        await wait_for(faulty.holding.is_set)
        for event_id in range(21, total + 1):
            writer.put(event(execution_id, event_id, last=total))
        # The append that stored 1-3 reserved every id emitted by then (up to 20): those
        # are shown; the ones emitted since wait for the next append to reserve them.
        assert [e.id for e in hub.unstored(execution_id)] == [*range(14, 21)]
        assert writer.shown_id == 20
        faulty.release.set()
    assert writer.refused is None, writer.refused
    page = await read_page(faulty, execution_id)
    assert_consistent(page)
    assert [e.id for e in page.events] == [1, 2, 3, *range(14, 21), 38, 39, 40]
    assert page.dropped == [(4, 13), (21, 37)]
    assert page.meta.status == "completed"
    frames = await replay(faulty, execution_id, cursor=0)
    assert [f.json for f in frames if f.event == "replay:gap"] == [
        {"after": 3, "resumeAt": 14, "reason": "dropped"},
        {"after": 20, "resumeAt": 38, "reason": "dropped"},
    ]
    assert check_view(frames)[-1]["id"] == total


async def test_a_reader_on_the_owning_process_gets_a_dropped_gap_for_events_never_shown(
    faulty: FaultyBuffer,
) -> None:
    # Appends fail but reads work: the reader replays an empty log and is shown
    # nothing (no id is reserved); events dropped meanwhile reach it as a gap.
    total = 30
    execution_id = await create(faulty)
    faulty.down = True
    async with Readers(buffer=faulty) as live:
        async with writing(faulty, execution_id, max_pending=10) as writer:
            publisher = live.hub.attach_local(execution_id, last_id=0)
            writer.show_to(publisher)
            for event_id in range(1, 4):
                writer.put(event(execution_id, event_id, last=total))
            await wait_for(lambda: len(faulty.attempts) >= 1)
            for event_id in range(4, total):
                writer.put(event(execution_id, event_id, last=total))
            reader = StreamReader(readers=live, execution_id=execution_id, cursor=0)
            reading = asyncio.create_task(read_frames(reader))
            await wait_for(lambda: len(faulty.attempts) >= 5)
            assert reader.last_sent == 0 and live.hub.unstored(execution_id) == []
            writer.put(event(execution_id, total, last=total))
            faulty.down = False
        publisher.detach(stored_id=writer.stored_id)
        frames = await asyncio.wait_for(reading, 10)
    # The terminal event pushed one more waiting event (23) out.
    assert [f.json for f in frames if f.event == "replay:gap"] == [
        {"after": 3, "resumeAt": 24, "reason": "dropped"}
    ]
    assert [e["id"] for e in check_view(frames)] == [1, 2, 3, *range(24, total + 1)]
    page = await read_page(faulty, execution_id)
    assert page.dropped == [(4, 23)] and page.meta.status == "completed"


async def read_frames(reader: StreamReader) -> list[Frame]:
    data = b"".join([chunk async for chunk in reader.frames()])
    return [parse_frame(raw) for raw in data.split(b"\n\n") if raw]


async def test_a_closed_live_gate_holds_events_back_until_a_renewal_opens_it(
    faulty: FaultyBuffer,
) -> None:
    """A failed lease renewal closes the gate at once: nothing more that is not stored
    is shown until a renewal succeeds (SPEC §5; step 15 fault review, F1). What the
    store did take is shown all the same: its ids are final, and a reader here would
    otherwise wait for it forever once the run let go (found by the fault-storm
    scenario: a stream stuck at the id the gate closed at)."""
    execution_id = await create(faulty)
    gate = LiveGate(lease_seconds=60)
    shown: list[int] = []
    writer = EventWriter(
        buffer=faulty,
        execution_id=execution_id,
        fence=FENCE,
        gate=gate,
        publish=lambda shown_event: shown.append(shown_event.id),
    )
    async with writer:
        writer.put(event(execution_id, 1, last=4))
        await wait_for(lambda: shown == [1])
        gate.close()
        faulty.down = True
        tried = len(faulty.attempts)
        for event_id in range(2, 5):
            writer.put(event(execution_id, event_id, last=4))
        await wait_for(lambda: len(faulty.attempts) > tried)  # an append was refused
        assert shown == [1] and writer.shown_id == 1
        faulty.down = False
        await wait_for(lambda: writer.stored_id == 4)
        assert shown == [1, 2, 3, 4], "stored events are shown, gate or not"
        gate.renewed(time.monotonic())
        assert shown == [1, 2, 3, 4]
    # A gate not renewed for a lease period is closed too (a stalled process). A lease
    # of seconds: with 50 ms, a test descheduled between renewing and asking would see
    # a closed gate on a busy machine.
    stale = LiveGate(lease_seconds=5, renewed_at=time.monotonic() - 10)
    assert not stale.open
    stale.renewed(time.monotonic())
    assert stale.open


async def test_in_an_outage_only_the_ids_reserved_ahead_are_shown(
    faulty: FaultyBuffer, redis: Redis
) -> None:
    """A burst reserves a block ahead with its append; when the buffer then becomes
    unreachable, events are shown up to that block and no further: past it they wait
    in memory (SPEC §5; step 15 fault review, F1)."""
    total = 300
    execution_id = await create(faulty)
    shown: list[int] = []
    writer = EventWriter(
        buffer=faulty,
        execution_id=execution_id,
        fence=FENCE,
        publish=lambda shown_event: shown.append(shown_event.id),
        retry_base_seconds=0.005,
        retry_max_seconds=0.05,
    )
    faulty.holds = lambda batch: batch[0].id == 1
    async with writer:
        writer.put(event(execution_id, 1, last=total))
        await wait_for(faulty.holding.is_set)
        for event_id in range(2, 102):  # a burst: 100 events during one append
            writer.put(event(execution_id, event_id, last=total))
        faulty.holds = lambda _batch: False
        faulty.release.set()
        await wait_for(lambda: writer.stored_id == 101)
        reserved = int(await redis.hget(faulty.keys.meta(execution_id), "reserved") or 0)
        assert reserved == writer.reserved > 101
        faulty.down = True
        for event_id in range(102, total):
            writer.put(event(execution_id, event_id, last=total))
        await wait_for(lambda: writer.failures >= 3)
        assert shown == list(range(1, reserved + 1))
        assert writer.shown_id == reserved
        writer.put(event(execution_id, total, last=total))
        faulty.down = False
    assert shown == list(range(1, total + 1))
    page = await read_page(faulty, execution_id)
    check_log(stored_envelopes(page))


async def test_an_unstored_event_is_shown_only_under_the_durable_ceiling_too(
    faulty: FaultyBuffer, redis: Redis, tmp_path: Path
) -> None:
    """Ids reserved ahead in Redis are shown unstored only once the durable ceiling
    (ceiling.py, in the value store) is above them: a store restored from an older
    snapshot forgets Redis's reservation, not the ceiling (step 15 fault review: an
    owner lost across a restore). Stored events are shown whatever the ceiling says."""
    total = 300
    execution_id = await create(faulty)
    values = HeldRecords(root=tmp_path)
    values.open.clear()
    ceiling = Ceiling(values=values, execution_id=execution_id, fence=FENCE, epoch=1, base=0)
    shown: list[int] = []
    writer = EventWriter(
        buffer=faulty,
        execution_id=execution_id,
        fence=FENCE,
        ceiling=ceiling,
        publish=lambda shown_event: shown.append(shown_event.id),
        retry_base_seconds=0.005,
        retry_max_seconds=0.05,
    )
    faulty.holds = lambda batch: batch[0].id == 1
    async with writer:
        writer.put(event(execution_id, 1, last=total))
        await wait_for(faulty.holding.is_set)
        for event_id in range(2, 102):  # a burst: Redis reserves a block ahead
            writer.put(event(execution_id, event_id, last=total))
        faulty.holds = lambda _batch: False
        faulty.release.set()
        await wait_for(lambda: writer.stored_id == 101)
        assert writer.reserved > 101
        faulty.down = True
        for event_id in range(102, total):
            writer.put(event(execution_id, event_id, last=total))
        await wait_for(lambda: writer.failures >= 3)
        assert shown == list(range(1, 102))  # stored, so shown; none past them
        values.open.set()
        await wait_for(lambda: ceiling.value > total)
        assert shown == list(range(1, writer.reserved + 1))
        writer.put(event(execution_id, total, last=total))
        faulty.down = False
    assert shown == list(range(1, total + 1))
    records = await values.records(execution_id)
    assert [orjson.loads(record)["ceiling"] for record in records] == [ceiling.value]


async def test_a_new_executions_first_event_is_shown_before_its_append_is_answered(
    faulty: FaultyBuffer, redis: Redis
) -> None:
    """start.lua reserves the first id with the creation, so ``execution:started`` is
    shown as it is emitted, not a round trip later (step 15, the event path's latency:
    the first frame waited for its append). Nothing past the reservation is shown
    before an append reserves it."""
    execution_id = await create(faulty, reserved=True)
    reserved = await redis.hget(faulty.keys.meta(execution_id), "reserved")
    shown: list[int] = []
    writer = EventWriter(
        buffer=faulty,
        execution_id=execution_id,
        fence=FENCE,
        reserved=int(reserved or 0),
        publish=lambda shown_event: shown.append(shown_event.id),
    )
    faulty.holds = lambda batch: batch[0].id == 1
    async with writer:
        writer.put(event(execution_id, 1, last=3))
        writer.put(event(execution_id, 2, last=3))
        await wait_for(faulty.holding.is_set)
        assert shown == [1] and writer.stored_id == 0
        writer.put(event(execution_id, 3, last=3))
        faulty.holds = lambda _batch: False
        faulty.release.set()
    assert shown == [1, 2, 3]
    check_log(stored_envelopes(await read_page(faulty, execution_id)))


def test_the_writer_state_table_covers_every_move_and_never_steps_a_repair_down() -> None:
    strength = list(WriterState)  # in order: in step, checking, writing back, recreating
    for state in WriterState:
        for move in Transition:
            after = TRANSITIONS[state, move]
            if state is WriterState.REFUSED or move is Transition.REFUSE:
                assert after is WriterState.REFUSED
            elif move is Transition.SETTLE:
                assert after is WriterState.IN_STEP
            else:
                assert strength.index(after) >= strength.index(state), (state, move, after)


def test_the_metadata_of_a_terminal_event_read_back_is_dated_by_its_envelope() -> None:
    """A run's end stored again (finals.py) is an event read back from the store: its
    batch dates ``updatedAt`` by the envelope's ``ts``, as a batch of a live run does
    (found by the fault tests: an ended run restored after a store loss got a 500)."""
    raw = orjson.dumps(
        {
            "id": 7,
            "type": "execution:completed",
            "executionId": "ex_1",
            "workflowId": "wf",
            "ts": "2026-12-02T10:00:00.000Z",
            "data": {"output": 1, "durationMs": 5},
        }
    )
    read_back = Event.stored(id=7, type="execution:completed", raw=raw)
    assert batch_meta([read_back])["updatedAt"] == "2026-12-02T10:00:00.000Z"
