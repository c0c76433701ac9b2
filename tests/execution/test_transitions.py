"""Each row of the ownership state machine (``ownership.TRANSITIONS``), on a real Valkey.

One test per row: it drives the transition through the module that makes it
(``Ownership``; the owner's pause and ending are its writer's appends, ``EventBuffer``),
checks the record it leaves in the metadata hash, then provokes every refusal the row
lists and checks the typed exception it becomes (``record.REFUSALS``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from lib.errors import NotFound, RecordLost, WriteFenced, WriteOutOfOrder, WrongStatus
from lib.execution.buffer import EventBuffer
from lib.execution.events import (
    EXECUTION_COMPLETED,
    EXECUTION_PAUSED,
    EXECUTION_STARTED,
    Event,
)
from lib.execution.flush import batch_meta
from lib.execution.ownership import TRANSITIONS, Ownership, Transition
from lib.execution.queue import Entered
from lib.execution.record import (
    REFUSALS,
    Field,
    Mode,
    RecoveryReason,
    Reply,
    Status,
    Takeover,
)
from lib.execution.values import LocalValueStore
from lib.execution.watchlists import WatchLists, lease_member
from lib.workflows.runstate import RunStates
from tests.support.ownership import ownership_parts

LEASE_SECONDS = 30.0
TESTED: dict[tuple[Status | None, str], str] = {}


def row_test(before: Status | None, name: str) -> Callable[[Any], Any]:
    """Mark a test as the one of the row (``before``, ``name``)."""

    def mark(test: Any) -> Any:
        TESTED[(before, name)] = test.__name__
        return test

    return mark


def row_of(before: Status | None, name: str) -> Transition:
    return next(row for row in TRANSITIONS if row.before == before and row.name == name)


@dataclass
class RowCheck:
    """Checks the refusals of one row: each as its typed exception, every one tried."""

    row: Transition
    tried: set[Reply] = field(default_factory=set)

    async def refused(self, reply: Reply, attempt: Awaitable[Any]) -> BaseException:
        assert reply in self.row.refusals, f"{reply} is not a refusal of {self.row.name}"
        expected = next(
            r.error for r in REFUSALS if r.script is self.row.script and r.reply is reply
        )
        with pytest.raises(expected) as caught:
            await attempt
        assert type(caught.value) is expected
        self.tried.add(reply)
        return caught.value

    def every_refusal_tried(self) -> None:
        assert self.tried == set(self.row.refusals)


@dataclass
class Machine:
    redis: Redis
    buffer: EventBuffer
    ownership: Ownership
    watch: WatchLists
    states: RunStates

    def with_lease(self, seconds: float) -> Ownership:
        return ownership_parts(self.buffer, seconds).ownership

    async def record(self, execution_id: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.buffer.keys.meta(execution_id))
        return {name.decode(): value.decode() for name, value in raw.items()}

    async def start(self, fence: str = "node-a:1", ownership: Ownership | None = None) -> str:
        execution_id = f"ex_{uuid.uuid4().hex}"
        await (ownership or self.ownership).start(
            execution_id,
            fence=fence,
            workflow_id="wf",
            tenant="t",
            created_at="2026-01-01T00:00:00.000Z",
            created_ms=1,
            state={"input": orjson.dumps({"v": 1})},
        )
        return execution_id

    async def queued(self, fence: str = "node-a:1") -> str:
        """An execution the accepting process had no slot for: in its tenant's line."""
        execution_id = f"ex_{uuid.uuid4().hex}"
        entered = await self.ownership.start(
            execution_id,
            fence=fence,
            workflow_id="wf",
            tenant="t",
            created_at="2026-01-01T00:00:00.000Z",
            created_ms=1,
            state={"input": orjson.dumps({"v": 1})},
            here=False,
        )
        assert isinstance(entered, Entered) and entered.queued
        return execution_id

    async def append(
        self, execution_id: str, types: list[str], *, fence: str, epoch: int = 1, first: int = 1
    ) -> None:
        events = [
            Event(
                id=first + i,
                type=kind,
                execution_id=execution_id,
                workflow_id="wf",
                data={"blockId": "ask", "prompt": "ok?"} if kind == EXECUTION_PAUSED else {},
            )
            for i, kind in enumerate(types)
        ]
        await self.buffer.append(
            execution_id, events, fence=fence, epoch=epoch, meta=batch_meta(events)
        )

    async def paused(self, fence: str = "node-a:1", *, deadline_ms: int | None = None) -> str:
        execution_id = await self.start(fence)
        await self.append(execution_id, [EXECUTION_STARTED, EXECUTION_PAUSED], fence=fence)
        await self.states.save(execution_id, {}, deadline_ms=deadline_ms)
        return execution_id

    async def held(self, *, for_ms: int = 30_000, at: int = 2) -> str:
        """A pause a replica stored again after the store came back empty (finals.py):
        held ``for_ms`` from now while its last id is ``at`` (the pause's is 2)."""
        execution_id = await self.paused("node-a:1")
        until_ms = await self.watch.now_ms() + for_ms
        await self.redis.hset(self.buffer.keys.meta(execution_id), Field.HELD, f"{at} {until_ms}")
        return execution_id

    async def finished(self, fence: str = "node-a:1") -> str:
        execution_id = await self.start(fence)
        await self.append(execution_id, [EXECUTION_STARTED, EXECUTION_COMPLETED], fence=fence)
        return execution_id

    async def until_lease_ended(self, execution_id: str) -> None:
        """Poll Redis's clock until the execution's lease is over."""
        until = int((await self.record(execution_id))[Field.LEASE_UNTIL])
        for _ in range(10_000):
            if await self.watch.now_ms() > until:
                return
        raise AssertionError("the lease never ended on Redis's clock")


@pytest.fixture
async def machine(redis: Redis, tmp_path: Path) -> AsyncIterator[Machine]:
    buffer = EventBuffer(redis=redis, prefix=f"tr{uuid.uuid4().hex[:6]}")
    parts = ownership_parts(buffer, LEASE_SECONDS)
    states = RunStates(buffer=buffer, values=LocalValueStore(root=tmp_path))
    yield Machine(redis, buffer, parts.ownership, parts.watch, states)


def missing() -> str:
    return f"ex_missing_{uuid.uuid4().hex}"


def claim(
    machine: Machine, execution_id: str, mode: Mode, fence: str, **options: Any
) -> Coroutine[Any, Any, Any]:
    return machine.ownership.claim(execution_id, mode, fence, **options)


# -- the rows ---------------------------------------------------------------------


@row_test(None, "start")
async def test_start_creates_a_running_record_owned_by_its_creator_with_a_watched_lease(
    machine: Machine,
) -> None:
    execution_id = await machine.start("node-a:1")
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING
    assert record[Field.OWNER] == "node-a:1" and record[Field.EPOCH] == "1"
    # Its first event's id is the creator's already: shown as it is emitted.
    assert record[Field.LAST_ID] == "0" and record[Field.RESERVED] == "1"
    assert int(record[Field.LEASE_UNTIL]) > await machine.watch.now_ms()
    lease = await machine.redis.zscore(
        machine.buffer.keys.leases, lease_member(execution_id, "node-a:1")
    )
    assert lease is not None
    RowCheck(row_of(None, "start")).every_refusal_tried()


@row_test(None, "queue")
async def test_a_start_without_a_free_slot_is_queued_owned_by_nobody(machine: Machine) -> None:
    execution_id = await machine.queued("node-a:1")
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.QUEUED
    assert record[Field.OWNER] == "" and record[Field.EPOCH] == "0"
    assert record[Field.RESERVED] == "0" and record[Field.LAST_ID] == "0"
    keys = machine.buffer.keys
    # In its tenant's line, with no lease to watch and nothing counted as running.
    assert await machine.redis.zscore(keys.queued("t"), execution_id) is not None
    assert await machine.redis.zscore(keys.waiting, "t") is not None
    assert await machine.redis.zscore(keys.leases, lease_member(execution_id, "node-a:1")) is None
    assert await machine.redis.zrange(keys.running("t"), 0, -1) == []
    # Behind a queued one, even a process with a free slot queues (the line is fair).
    assert isinstance(
        await machine.ownership.start(
            f"ex_{uuid.uuid4().hex}",
            fence="node-a:2",
            workflow_id="wf",
            tenant="t",
            created_at="2026-01-01T00:00:00.000Z",
            created_ms=2,
        ),
        Entered,
    )
    RowCheck(row_of(None, "queue")).every_refusal_tried()


@row_test(Status.QUEUED, "take")
async def test_a_worker_takes_a_queued_execution_once(machine: Machine) -> None:
    check = RowCheck(row_of(Status.QUEUED, "take"))
    execution_id = await machine.queued()
    queue = machine.ownership.queue
    taken = await queue.take("node-w:1")
    assert taken is not None and taken.execution_id == execution_id
    won = await machine.ownership.claim(execution_id, Mode.TAKE, "node-w:1", expected="1")
    assert won.status_before is Status.QUEUED and won.last_id == 0
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING and record[Field.OWNER] == "node-w:1"
    assert record[Field.EPOCH] == "1" and record[Field.RESERVED] == "1"
    # The same delivery claimed again by another worker (a duplicate) is dropped.
    await check.refused(
        Reply.STATUS, machine.ownership.claim(execution_id, Mode.TAKE, "node-x:1", expected="1")
    )
    await check.refused(
        Reply.NOEXEC, machine.ownership.claim(missing(), Mode.TAKE, "node-x:1", expected="1")
    )
    assert (await machine.record(execution_id))[Field.OWNER] == "node-w:1"
    # A taker whose delivery a janitor revoked (it was slower than a lease) is dropped.
    given_back = await machine.queued()
    assert await machine.ownership.revoke(given_back, "node-y:1") is True
    await check.refused(
        Reply.REVOKED, machine.ownership.claim(given_back, Mode.TAKE, "node-y:1", expected="1")
    )
    check.every_refusal_tried()


@row_test(Status.QUEUED, "revoke")
async def test_a_delivery_revoked_fences_its_late_taker_out(machine: Machine) -> None:
    """A taker slower than a lease: the janitor revokes its delivery and queues it
    again; its claim, when it comes, is refused and the next taker's wins, so the two
    never run it (nor its tenant past its cap: the revoked one's admission went back)."""
    check = RowCheck(row_of(Status.QUEUED, "revoke"))
    execution_id = await machine.queued()
    queue = machine.ownership.queue
    slow = await queue.take("node-w:1")
    assert slow is not None and slow.fence == "node-w:1"
    assert await machine.ownership.revoke(execution_id, slow.fence) is True
    assert await queue.requeue(slow) is True
    assert not await machine.redis.zscore(queue.keys.running("t"), "node-w:1")
    next_taker = await queue.take("node-w:2")
    assert next_taker is not None and next_taker.execution_id == execution_id
    take_row = RowCheck(row_of(Status.QUEUED, "take"))
    await take_row.refused(
        Reply.REVOKED, machine.ownership.claim(execution_id, Mode.TAKE, "node-w:1", expected="1")
    )
    won = await machine.ownership.claim(execution_id, Mode.TAKE, "node-w:2", expected="1")
    assert won.status_before is Status.QUEUED
    assert (await machine.record(execution_id))[Field.OWNER] == "node-w:2"
    # Claimed: too late to revoke (the janitor then only closes the delivery).
    await check.refused(Reply.STATUS, machine.ownership.revoke(execution_id, next_taker.fence))
    # Revoked before its record exists (a start's record comes a round trip after its
    # line's entry): False, and the mark waits for it.
    assert await machine.ownership.revoke(missing(), "node-w:3") is False
    check.every_refusal_tried()


@row_test(Status.QUEUED, "cancel")
async def test_a_queued_execution_cancelled_becomes_its_cancellers_to_end(
    machine: Machine,
) -> None:
    check = RowCheck(row_of(Status.QUEUED, "cancel"))
    execution_id = await machine.queued()
    won = await machine.ownership.claim(execution_id, Mode.CANCEL, "node-c:1")
    assert won.status_before is Status.QUEUED and won.cancel_requested
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING and record[Field.OWNER] == "node-c:1"
    # A worker that took it before the cancel is refused its claim: it never runs.
    await check.refused(
        Reply.STATUS, machine.ownership.claim(execution_id, Mode.TAKE, "node-w:1", expected="1")
    )
    await check.refused(Reply.NOEXEC, machine.ownership.claim(missing(), Mode.CANCEL, "n:1"))
    finished = await machine.finished()
    await check.refused(Reply.STATUS, machine.ownership.claim(finished, Mode.CANCEL, "n:1"))
    check.every_refusal_tried()


@row_test(Status.RUNNING, "pause")
async def test_the_owner_pauses_by_storing_its_paused_event(machine: Machine) -> None:
    check = RowCheck(row_of(Status.RUNNING, "pause"))
    execution_id = await machine.start("node-a:1")
    await machine.append(execution_id, [EXECUTION_STARTED, EXECUTION_PAUSED], fence="node-a:1")
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.PAUSED and record[Field.PAUSE_BLOCK] == "ask"
    assert record[Field.LAST_ID] == "2" and record[Field.RESERVED] == "2"

    await check.refused(
        Reply.NOEXEC, machine.append(missing(), [EXECUTION_PAUSED], fence="node-a:1")
    )
    other = await machine.start("node-b:1")
    fenced = await check.refused(
        Reply.FENCED, machine.append(other, [EXECUTION_PAUSED], fence="node-a:1")
    )
    assert isinstance(fenced, WriteFenced) and fenced.owner == "node-b:1"
    order = await check.refused(
        Reply.ORDER, machine.append(other, [EXECUTION_PAUSED], fence="node-b:1", first=5)
    )
    assert isinstance(order, WriteOutOfOrder) and order.last_id == 0
    await machine.ownership.claim(other, Mode.CANCEL, "node-c:1")
    await check.refused(
        Reply.CANCEL,
        machine.append(other, [EXECUTION_STARTED, EXECUTION_PAUSED], fence="node-b:1"),
    )
    assert (await machine.record(other))[Field.LAST_ID] == "0", "a refused batch wrote"
    check.every_refusal_tried()


@row_test(Status.RUNNING, "complete")
async def test_the_owner_ends_the_run_by_storing_its_terminal_event(machine: Machine) -> None:
    check = RowCheck(row_of(Status.RUNNING, "complete"))
    execution_id = await machine.finished("node-a:1")
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.COMPLETED and record[Field.LAST_ID] == "2"
    ttl = await machine.redis.ttl(machine.buffer.keys.meta(execution_id))
    assert 0 < ttl <= machine.buffer.retention_seconds

    await check.refused(
        Reply.NOEXEC, machine.append(missing(), [EXECUTION_COMPLETED], fence="node-a:1")
    )
    # A stalled owner that wakes after a takeover is fenced out of its ending.
    stale = await machine.start("node-a:1", machine.with_lease(0.05))
    await machine.until_lease_ended(stale)
    await machine.ownership.claim(stale, Mode.TAKEOVER, "node-b:1", expected="node-a:1")
    await check.refused(
        Reply.FENCED, machine.append(stale, [EXECUTION_COMPLETED], fence="node-a:1")
    )
    await check.refused(
        Reply.ORDER,
        machine.append(execution_id, [EXECUTION_COMPLETED], fence="node-a:1", first=2),
    )
    cancelled = await machine.start("node-a:1")
    await machine.ownership.claim(cancelled, Mode.CANCEL, "node-c:1")
    await check.refused(
        Reply.CANCEL,
        machine.append(cancelled, [EXECUTION_STARTED, EXECUTION_COMPLETED], fence="node-a:1"),
    )
    assert (await machine.record(cancelled))[Field.STATUS] == Status.RUNNING
    check.every_refusal_tried()


@row_test(Status.RUNNING, "renew")
async def test_the_owner_renews_its_lease_and_hears_of_a_cancel(machine: Machine) -> None:
    check = RowCheck(row_of(Status.RUNNING, "renew"))
    ownership = machine.ownership
    execution_id = await machine.start("node-a:1")
    before = int((await machine.record(execution_id))[Field.LEASE_UNTIL])
    assert await ownership.renew(execution_id, "node-a:1", 1, "t") is False
    after = int((await machine.record(execution_id))[Field.LEASE_UNTIL])
    assert after >= before
    await ownership.claim(execution_id, Mode.CANCEL, "node-c:1")
    assert await ownership.renew(execution_id, "node-a:1", 1, "t") is True
    assert (await machine.record(execution_id))[Field.OWNER] == "node-a:1"

    lost = await check.refused(Reply.GONE, ownership.renew(missing(), "node-a:1", 1, "t"))
    assert isinstance(lost, RecordLost) and lost.whole
    await check.refused(Reply.FENCED, ownership.renew(execution_id, "node-b:1", 1, "t"))
    behind = await check.refused(
        Reply.BEHIND, ownership.renew(execution_id, "node-a:1", 1, "t", stored_id=9)
    )
    assert isinstance(behind, RecordLost) and not behind.whole
    check.every_refusal_tried()


@row_test(Status.PAUSED, "resume")
async def test_any_process_resumes_a_pause_once_with_its_answer_checkpointed(
    machine: Machine,
) -> None:
    check = RowCheck(row_of(Status.PAUSED, "resume"))
    execution_id = await machine.paused("node-a:1")
    won = await claim(
        machine, execution_id, Mode.RESUME, "node-b:1", block_id="ask", answer=b'{"ok":true}'
    )
    assert won.status_before is Status.PAUSED and won.owner == "node-b:1" and won.epoch == 2
    assert won.last_id == 2 and won.base == 2
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING and record[Field.OWNER] == "node-b:1"
    assert record[Field.PAUSE_BLOCK] == "" and Field.CANCEL_REQUESTED not in record
    state = await machine.redis.hget(machine.buffer.keys.state(execution_id), "a:ask")
    assert state == b'{"ok":true}'

    await check.refused(Reply.NOEXEC, claim(machine, missing(), Mode.RESUME, "node-c:1"))
    status = await check.refused(
        Reply.STATUS, claim(machine, execution_id, Mode.RESUME, "node-c:1")
    )
    assert isinstance(status, WrongStatus) and status.status == Status.RUNNING
    other = await machine.paused("node-a:1")
    block = await check.refused(
        Reply.BLOCK, claim(machine, other, Mode.RESUME, "node-c:1", block_id="elsewhere")
    )
    assert block.paused_at == "ask" and block.asked == "elsewhere"  # type: ignore[attr-defined]
    # Stored again after the store came back empty: held a lease, then answered as ever
    # (and not held once a later event follows the pause).
    held = await machine.held()
    refused = await check.refused(Reply.HELD, claim(machine, held, Mode.RESUME, "node-c:1"))
    assert 1 <= refused.retry_after <= 30  # type: ignore[attr-defined]
    assert (await machine.record(held))[Field.STATUS] == Status.PAUSED
    over = await machine.held(for_ms=-1)
    assert (await claim(machine, over, Mode.RESUME, "node-c:1")).owner == "node-c:1"
    moved_on = await machine.held(at=1)
    assert (await claim(machine, moved_on, Mode.RESUME, "node-c:1")).owner == "node-c:1"
    # While the store is behind (store.py), every pause is held that long, whatever it is.
    paused = await machine.paused("node-a:1")
    behind = await check.refused(
        Reply.HELD, claim(machine, paused, Mode.RESUME, "node-c:1", behind_ms=4_500)
    )
    assert behind.retry_after == 5  # type: ignore[attr-defined]
    assert (await machine.record(paused))[Field.STATUS] == Status.PAUSED
    check.every_refusal_tried()


@row_test(Status.PAUSED, "resume later")
async def test_a_resume_that_may_not_run_now_waits_in_line_with_its_answer(
    machine: Machine,
) -> None:
    check = RowCheck(row_of(Status.PAUSED, "resume later"))
    execution_id = await machine.paused("node-a:1")
    won = await claim(
        machine,
        execution_id,
        Mode.RESUME,
        "node-b:1",
        block_id="ask",
        answer=b'{"ok":true}',
        later=True,
    )
    assert won.status_before is Status.PAUSED and won.owner == ""
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.QUEUED and record[Field.OWNER] == ""
    assert record[Field.CONTINUES] == "ask" and record[Field.PAUSE_BLOCK] == ""
    state = await machine.redis.hget(machine.buffer.keys.state(execution_id), "a:ask")
    assert state == b'{"ok":true}'
    # A worker takes it on from the answer: it numbers after the pause, nothing reserved.
    taken = await claim(machine, execution_id, Mode.TAKE, "node-w:1", expected="1")
    assert taken.status_before is Status.QUEUED and taken.base == 2
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING and Field.CONTINUES not in record
    assert record[Field.RESERVED] == "2" and record[Field.OWNER] == "node-w:1"

    await check.refused(
        Reply.NOEXEC, claim(machine, missing(), Mode.RESUME, "node-c:1", later=True)
    )
    status = await check.refused(
        Reply.STATUS, claim(machine, execution_id, Mode.RESUME, "node-c:1", later=True)
    )
    assert isinstance(status, WrongStatus) and status.status == Status.RUNNING
    other = await machine.paused("node-a:1")
    await check.refused(
        Reply.BLOCK,
        claim(machine, other, Mode.RESUME, "node-c:1", block_id="elsewhere", later=True),
    )
    assert (await machine.record(other))[Field.STATUS] == Status.PAUSED
    held = await machine.held()
    await check.refused(Reply.HELD, claim(machine, held, Mode.RESUME, "node-c:1", later=True))
    assert (await machine.record(held))[Field.STATUS] == Status.PAUSED
    check.every_refusal_tried()


@row_test(Status.PAUSED, "cancel")
async def test_any_process_cancelling_a_pause_owns_it_to_write_the_cancel(
    machine: Machine,
) -> None:
    check = RowCheck(row_of(Status.PAUSED, "cancel"))
    execution_id = await machine.paused("node-a:1")
    won = await claim(machine, execution_id, Mode.CANCEL, "node-b:1")
    assert won.status_before is Status.PAUSED and won.owner == "node-b:1" and won.epoch == 2
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING and record[Field.OWNER] == "node-b:1"
    assert record[Field.CANCEL_REQUESTED] == "1"

    await check.refused(Reply.NOEXEC, claim(machine, missing(), Mode.CANCEL, "node-c:1"))
    finished = await machine.finished()
    status = await check.refused(Reply.STATUS, claim(machine, finished, Mode.CANCEL, "node-c:1"))
    assert isinstance(status, WrongStatus) and status.code == "execution_completed"
    held = await machine.held()
    await check.refused(Reply.HELD, claim(machine, held, Mode.CANCEL, "node-c:1"))
    assert Field.CANCEL_REQUESTED not in await machine.record(held)
    paused = await machine.paused("node-a:1")
    await check.refused(Reply.HELD, claim(machine, paused, Mode.CANCEL, "node-c:1", behind_ms=800))
    assert Field.CANCEL_REQUESTED not in await machine.record(paused)
    check.every_refusal_tried()


@row_test(Status.RUNNING, "cancel")
async def test_any_process_cancelling_a_running_execution_flags_it_for_its_owner(
    machine: Machine,
) -> None:
    check = RowCheck(row_of(Status.RUNNING, "cancel"))
    execution_id = await machine.start("node-a:1")
    won = await claim(machine, execution_id, Mode.CANCEL, "node-b:1")
    assert won.status_before is Status.RUNNING
    assert won.owner == "node-a:1" and won.epoch == 1, "a flag, not a new owner"
    record = await machine.record(execution_id)
    assert record[Field.OWNER] == "node-a:1" and record[Field.CANCEL_REQUESTED] == "1"

    await check.refused(Reply.NOEXEC, claim(machine, missing(), Mode.CANCEL, "node-c:1"))
    finished = await machine.finished()
    await check.refused(Reply.STATUS, claim(machine, finished, Mode.CANCEL, "node-c:1"))
    check.every_refusal_tried()


@row_test(Status.PAUSED, "expire")
async def test_a_janitor_expires_a_pause_only_past_its_deadline(machine: Machine) -> None:
    check = RowCheck(row_of(Status.PAUSED, "expire"))
    now = await machine.watch.now_ms()
    execution_id = await machine.paused("node-a:1", deadline_ms=now - 1)
    won = await claim(machine, execution_id, Mode.EXPIRE, "node-b:1")
    assert won.status_before is Status.PAUSED and won.owner == "node-b:1" and won.epoch == 2
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING and record[Field.PAUSE_DEADLINE] == ""

    await check.refused(Reply.NOEXEC, claim(machine, missing(), Mode.EXPIRE, "node-c:1"))
    await check.refused(Reply.STATUS, claim(machine, execution_id, Mode.EXPIRE, "node-c:1"))
    later = await machine.paused("node-a:1", deadline_ms=now + 3_600_000)
    await check.refused(Reply.NOTDUE, claim(machine, later, Mode.EXPIRE, "node-c:1"))
    never = await machine.paused("node-a:1")
    await check.refused(Reply.NOTDUE, claim(machine, never, Mode.EXPIRE, "node-c:1"))
    assert (await machine.record(later))[Field.OWNER] == "node-a:1"
    check.every_refusal_tried()


@row_test(Status.RUNNING, "take over")
async def test_a_janitor_takes_over_past_the_lease_or_once_handed_off(machine: Machine) -> None:
    check = RowCheck(row_of(Status.RUNNING, "take over"))
    execution_id = await machine.start("node-a:1", machine.with_lease(0.05))
    await machine.append(execution_id, [EXECUTION_STARTED], fence="node-a:1")
    await machine.until_lease_ended(execution_id)
    won = await claim(machine, execution_id, Mode.TAKEOVER, "node-b:1", expected="node-a:1")
    assert won.status_before is Status.RUNNING and won.owner == "node-b:1" and won.epoch == 2
    assert won.reason is RecoveryReason.WORKER_LOST and won.recovery == 1 and won.crashes == 1
    record = await machine.record(execution_id)
    assert record[Field.OWNER] == "node-b:1" and record[Field.CRASHES] == "1"
    assert record[Field.RECOVERY_REASON] == RecoveryReason.WORKER_LOST

    handed = await machine.start("node-a:1")
    await machine.ownership.hand_off(handed, "node-a:1", shown_id=0)
    won = await claim(
        machine, handed, Mode.TAKEOVER, "node-b:1", expected="node-a:1", takeover=Takeover.HANDOFF
    )
    assert won.reason is RecoveryReason.HANDOFF and won.crashes == 0
    assert Field.HANDOFF not in await machine.record(handed)

    # The next process of a node proved dead takes its runs at once, lease or not, but
    # only from the owner it names.
    orphan = await machine.start("node-d:1")
    won = await claim(
        machine, orphan, Mode.TAKEOVER, "node-d2:1", expected="node-d:1", takeover=Takeover.DEAD
    )
    assert won.reason is RecoveryReason.WORKER_LOST and won.owner == "node-d2:1"

    await check.refused(Reply.NOEXEC, claim(machine, missing(), Mode.TAKEOVER, "node-c:1"))
    paused = await machine.paused("node-a:1")
    await check.refused(Reply.STATUS, claim(machine, paused, Mode.TAKEOVER, "node-c:1"))
    alive = await machine.start("node-a:1")
    await check.refused(
        Reply.LEASE, claim(machine, alive, Mode.TAKEOVER, "node-c:1", expected="node-a:1")
    )
    await check.refused(
        Reply.LEASE,
        claim(machine, alive, Mode.TAKEOVER, "node-c:1", expected="", takeover=Takeover.HANDOFF),
    )
    await check.refused(
        Reply.MOVED, claim(machine, alive, Mode.TAKEOVER, "node-c:1", expected="node-z:1")
    )
    await check.refused(
        Reply.MOVED,
        claim(
            machine, alive, Mode.TAKEOVER, "node-c:1", expected="node-z:1", takeover=Takeover.DEAD
        ),
    )
    assert (await machine.record(alive))[Field.OWNER] == "node-a:1"
    # A process that runs a suspect takes no other run whose owners died twice (blame.py).
    crashed = await machine.start("node-a:1", machine.with_lease(0.05))
    await machine.redis.hset(machine.buffer.keys.meta(crashed), "deaths", 1)  # died before
    await machine.until_lease_ended(crashed)
    await check.refused(
        Reply.SUSPECT,
        claim(machine, crashed, Mode.TAKEOVER, "node-c:1", expected="node-a:1", busy=True),
    )
    assert (await machine.record(crashed))[Field.OWNER] == "node-a:1"
    check.every_refusal_tried()


@row_test(Status.RUNNING, "hand off")
async def test_the_owner_hands_off_at_a_shutdown_leaving_no_owner(machine: Machine) -> None:
    check = RowCheck(row_of(Status.RUNNING, "hand off"))
    keys = machine.buffer.keys
    execution_id = await machine.start("node-a:1")
    await machine.ownership.hand_off(execution_id, "node-a:1", shown_id=0)
    record = await machine.record(execution_id)
    assert record[Field.STATUS] == Status.RUNNING and record[Field.OWNER] == ""
    assert record[Field.HANDOFF] == "node-a:1" and record[Field.LEASE_UNTIL] == "0"
    lease = await machine.redis.zscore(keys.leases, lease_member(execution_id, "node-a:1"))
    assert lease == 0, "due at once for every janitor"
    announced = await machine.redis.xrange(keys.handoffs)
    assert any(fields[b"executionId"] == execution_id.encode() for _, fields in announced)

    # The ids it reserved but never showed go back (F3 of the step 15 review): the next
    # owner numbers from the last one a client may have seen, and reports no gap.
    bursting = await machine.start("node-a:1")
    await machine.redis.hset(keys.meta(bursting), Field.RESERVED, 50)
    await machine.ownership.hand_off(bursting, "node-a:1", shown_id=7)
    assert (await machine.record(bursting))[Field.RESERVED] == "7"

    await check.refused(Reply.NOEXEC, machine.ownership.hand_off(missing(), "node-a:1", shown_id=0))
    paused = await machine.paused("node-a:1")
    await check.refused(Reply.STATUS, machine.ownership.hand_off(paused, "node-a:1", shown_id=0))
    other = await machine.start("node-b:1")
    await check.refused(Reply.MOVED, machine.ownership.hand_off(other, "node-a:1", shown_id=0))
    assert (await machine.record(other))[Field.OWNER] == "node-b:1"
    check.every_refusal_tried()


def test_every_row_of_the_table_has_its_test() -> None:
    rows = {(row.before, row.name) for row in TRANSITIONS}
    assert rows == set(TESTED), "a row without a test, or a test without a row"
    assert len(TRANSITIONS) == len(rows), "two rows with the same state and transition"


async def test_a_refused_claim_leaves_the_record_as_it_was(machine: Machine) -> None:
    execution_id = await machine.finished("node-a:1")
    before = await machine.record(execution_id)
    for mode in (Mode.RESUME, Mode.CANCEL, Mode.TAKEOVER, Mode.HANDOFF, Mode.EXPIRE, Mode.TAKE):
        with pytest.raises(WrongStatus):
            await claim(machine, execution_id, mode, "node-b:1")
    assert await machine.record(execution_id) == before
    with pytest.raises(NotFound):
        await claim(machine, missing(), Mode.RESUME, "node-b:1")
