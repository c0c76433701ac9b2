"""claim.lua's contract on a real Valkey: each transition's reply and every refusal
(NOEXEC, STATUS, BLOCK, LEASE, MOVED, NOTDUE, MODE, SUSPECT, REVOKED), each refusal
writing nothing; a revoked delivery's take refused however late it comes; a takeover's
charge for each verdict on its owner's death (blame.py)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from tests.execution.scripts.contract import now_ms, refusal, script

OWNER, NEW = "node-a:1111", "node-b:2222"
LEASE_MS = 15_000
FAR = 10**13  # a lease or deadline that has not passed


async def execution(redis: Redis, keys: Keys, eid: str, **fields: Any) -> None:
    """An execution 5 events in, 9 ids reserved, owned by OWNER at epoch 2."""
    base = {"status": "running", "owner": OWNER, "epoch": 2, "lastId": 5, "reserved": 9}
    await redis.hset(keys.meta(eid), mapping={"leaseUntil": FAR, **base, **fields})


def claim(
    redis: Redis,
    keys: Keys,
    eid: str,
    mode: str,
    token: str = NEW,
    *,
    argument: str = "",
    handoff_only: bool = False,
    answer: str = "",
    base_at_least: int = 0,
    verdict: str = "",
    busy: bool = False,
) -> Any:
    args = [
        mode, token, LEASE_MS, argument, "handoff" if handoff_only else "", answer, base_at_least,
        verdict, "busy" if busy else "",
    ]  # fmt: skip
    keys_of = [keys.meta(eid), keys.state(eid), keys.revoked(eid)]
    return script(redis, "claim.lua")(keys=keys_of, args=args)


async def meta(redis: Redis, keys: Keys, eid: str) -> dict[str, str]:
    raw = await redis.hgetall(keys.meta(eid))
    return {name.decode(): value.decode() for name, value in raw.items()}


async def assert_owned_by_new(redis: Redis, keys: Keys, eid: str, before_ms: int) -> None:
    """The fields every winning claim sets: the caller owns it, running, one epoch on."""
    stored = await meta(redis, keys, eid)
    after_ms = await now_ms(redis, keys.meta(eid))
    assert before_ms + LEASE_MS <= int(stored["leaseUntil"]) <= after_ms + LEASE_MS
    assert (stored["owner"], stored["epoch"], stored["status"]) == (NEW, "3", "running")
    assert (stored["pauseBlock"], stored["pauseDeadline"], stored["reserved"]) == ("", "", "9")
    assert "handoff" not in stored


async def test_resume_gives_a_paused_execution_to_the_caller_with_the_answer(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(
        redis, keys, eid, status="paused", owner="", pauseBlock="q", pauseDeadline=FAR,
        cancelRequested="1", recoveries=2, crashes=1,
    )  # fmt: skip
    before = await now_ms(redis, keys.meta(eid))
    reply = await claim(redis, keys, eid, "resume", argument="q", answer='{"ok": true}')
    assert reply == [5, 9, b"paused", NEW.encode(), 3, 2, b"", 1, b"0", 0]
    await assert_owned_by_new(redis, keys, eid, before)
    assert "cancelRequested" not in await meta(redis, keys, eid)
    assert await redis.hgetall(keys.state(eid)) == {b"a:q": b'{"ok": true}'}


async def test_resume_of_whichever_block_without_an_answer_writes_no_run_state(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, status="paused", pauseBlock="q")
    reply = await claim(redis, keys, eid, "resume")
    assert reply[2:5] == [b"paused", NEW.encode(), 3]
    assert await redis.exists(keys.state(eid)) == 0


async def test_a_claim_sent_again_answers_as_the_first_did(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, status="paused", pauseBlock="q")
    first = await claim(redis, keys, eid, "resume", argument="q")
    assert await claim(redis, keys, eid, "resume", argument="q") == first


async def test_a_resume_sent_again_answers_with_the_stored_recovery_reason(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """As the header says; only a takeover's caller reads the reason (runner.py)."""
    await execution(redis, keys, eid, status="paused", recoveryReason="worker_lost")
    first = await claim(redis, keys, eid, "resume")
    again = await claim(redis, keys, eid, "resume")
    assert first[6] == b"" and again[6] == b"worker_lost"
    assert again[:6] == first[:6] and again[7] == first[7]


async def test_a_handoff_sent_again_is_refused_as_moved(redis: Redis, keys: Keys, eid: str) -> None:
    await execution(redis, keys, eid)
    await claim(redis, keys, eid, "handoff", OWNER)
    assert await refusal(claim(redis, keys, eid, "handoff", OWNER)) == "MOVED"


async def test_cancel_of_a_running_execution_only_flags_it_for_its_owner(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, recoveries=1, crashes=1)
    before = await meta(redis, keys, eid)
    reply = await claim(redis, keys, eid, "cancel")
    assert reply == [5, 9, b"running", OWNER.encode(), 2, 1, b"", 1, b"1", 0]
    assert await meta(redis, keys, eid) == {**before, "cancelRequested": "1"}


async def test_cancel_of_a_paused_execution_gives_it_to_the_caller_flagged(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, status="paused", owner="", pauseBlock="q")
    before = await now_ms(redis, keys.meta(eid))
    reply = await claim(redis, keys, eid, "cancel")
    assert reply == [5, 9, b"paused", NEW.encode(), 3, 0, b"", 0, b"1", 0]
    await assert_owned_by_new(redis, keys, eid, before)
    assert (await meta(redis, keys, eid))["cancelRequested"] == "1"


@pytest.mark.parametrize("expected", [OWNER, ""])
async def test_takeover_past_the_lease_is_a_crash_that_keeps_a_requested_cancel(
    redis: Redis, keys: Keys, eid: str, expected: str
) -> None:
    past = await now_ms(redis, keys.meta(eid)) - 1
    await execution(redis, keys, eid, leaseUntil=past, cancelRequested="1", recoveries=1, crashes=2)
    before = await now_ms(redis, keys.meta(eid))
    reply = await claim(redis, keys, eid, "takeover", argument=expected)
    assert reply == [5, 9, b"running", NEW.encode(), 3, 2, b"worker_lost", 3, b"1", 1]
    await assert_owned_by_new(redis, keys, eid, before)
    stored = await meta(redis, keys, eid)
    assert (stored["recoveryReason"], stored["crashes"], stored["cancelRequested"]) == (
        "worker_lost", "3", "1",
    )  # fmt: skip


@pytest.mark.parametrize("handoff_only", [False, True])
async def test_takeover_of_a_handed_off_execution_is_no_crash(
    redis: Redis, keys: Keys, eid: str, handoff_only: bool
) -> None:
    await execution(redis, keys, eid, owner="", handoff=OWNER, leaseUntil=0, crashes=1)
    before = await now_ms(redis, keys.meta(eid))
    reply = await claim(redis, keys, eid, "takeover", argument=OWNER, handoff_only=handoff_only)
    assert reply == [5, 9, b"running", NEW.encode(), 3, 1, b"handoff", 1, b"0", 0]
    await assert_owned_by_new(redis, keys, eid, before)
    assert (await meta(redis, keys, eid))["recoveryReason"] == "handoff"


@pytest.mark.parametrize(("floor", "base"), [(4_200, 4_200), (7, 9)])
async def test_a_takeover_numbers_from_the_base_at_least_it_is_given_when_above_the_store(
    redis: Redis, keys: Keys, eid: str, floor: int, base: int
) -> None:
    """ARGV[7], the durable ceiling a takeover after a restore passes (ceiling.py): the
    new owner numbers above it, and it is the reservation from then on; one below what
    the store reserved changes nothing."""
    await execution(redis, keys, eid, leaseUntil=0)
    reply = await claim(redis, keys, eid, "takeover", argument=OWNER, base_at_least=floor)
    assert reply[:3] == [5, base, b"running"]
    assert (await meta(redis, keys, eid))["reserved"] == str(base)
    assert await claim(redis, keys, eid, "takeover", argument=OWNER, base_at_least=floor) == reply


@pytest.mark.parametrize("mode", ["resume", "cancel", "expire"])
async def test_every_claim_that_takes_over_numbers_from_the_base_at_least(
    redis: Redis, keys: Keys, eid: str, mode: str
) -> None:
    """A resume, cancel or expiry of a pause the store brought back from a snapshot
    numbers above the durable ceiling too (the fault storm: a cancel after a restore
    stored its event under an id a client had seen as another)."""
    await execution(redis, keys, eid, status="paused", owner="", pauseBlock="q", pauseDeadline=1)
    reply = await claim(redis, keys, eid, mode, base_at_least=4_200)
    assert reply[:2] == [5, 4_200]
    assert (await meta(redis, keys, eid))["reserved"] == "4200"


async def test_a_cancel_that_only_flags_a_running_execution_moves_no_base(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid)
    reply = await claim(redis, keys, eid, "cancel", base_at_least=4_200)
    assert reply[:2] == [5, 9]
    assert (await meta(redis, keys, eid))["reserved"] == "9"


async def test_a_takeover_sent_again_answers_with_the_recovery_it_started(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, leaseUntil=0, recoveries=1)
    first = await claim(redis, keys, eid, "takeover", argument=OWNER)
    assert first[5:7] == [2, b"worker_lost"]
    assert await claim(redis, keys, eid, "takeover", argument=OWNER) == first


async def test_handoff_lets_go_of_the_callers_execution(redis: Redis, keys: Keys, eid: str) -> None:
    await execution(redis, keys, eid, recoveries=1, crashes=1)
    reply = await claim(redis, keys, eid, "handoff", OWNER)
    assert reply == [5, 9, b"running", b"", 2, 1, b"handoff", 1, b"0", 0]
    stored = await meta(redis, keys, eid)
    assert (stored["owner"], stored["handoff"], stored["leaseUntil"]) == ("", OWNER, "0")
    assert (stored["status"], stored["epoch"]) == ("running", "2")


async def test_expire_gives_a_pause_past_its_deadline_to_the_caller(
    redis: Redis, keys: Keys, eid: str
) -> None:
    past = await now_ms(redis, keys.meta(eid)) - 1
    await execution(redis, keys, eid, status="paused", pauseBlock="q", pauseDeadline=past)
    before = await now_ms(redis, keys.meta(eid))
    reply = await claim(redis, keys, eid, "expire")
    assert reply == [5, 9, b"paused", NEW.encode(), 3, 0, b"", 0, b"0", 0]
    await assert_owned_by_new(redis, keys, eid, before)


async def test_the_base_is_the_last_id_when_nothing_was_reserved_above_it(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, lastId=12, reserved=3, leaseUntil=0)
    reply = await claim(redis, keys, eid, "takeover")
    assert reply[:2] == [12, 12]
    assert (await meta(redis, keys, eid))["reserved"] == "12"


@pytest.mark.parametrize("mode", ["resume", "cancel", "takeover", "handoff", "expire"])
async def test_noexec_for_an_execution_that_does_not_exist(
    redis: Redis, keys: Keys, eid: str, mode: str
) -> None:
    assert await refusal(claim(redis, keys, eid, mode)) == "NOEXEC"
    assert await redis.exists(keys.meta(eid), keys.state(eid)) == 0


@pytest.mark.parametrize(
    ("status", "mode"),
    [
        ("running", "resume"),
        ("completed", "cancel"),
        ("paused", "takeover"),
        ("paused", "handoff"),
        ("running", "expire"),
    ],
)
async def test_status_names_a_state_the_transition_does_not_apply_to(
    redis: Redis, keys: Keys, eid: str, status: str, mode: str
) -> None:
    # No saved deadline: a running execution with one is NOTDUE to expire (its pause is
    # not stored yet), see test_notdue_before_the_deadline_or_without_one.
    await execution(redis, keys, eid, status=status, leaseUntil=0, pauseDeadline="")
    before = await meta(redis, keys, eid)
    assert await refusal(claim(redis, keys, eid, mode, OWNER + "x")) == f"STATUS {status}"
    assert await meta(redis, keys, eid) == before


async def test_block_names_the_block_the_execution_is_paused_at(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, status="paused", pauseBlock="q")
    before = await meta(redis, keys, eid)
    refused = await refusal(claim(redis, keys, eid, "resume", argument="r", answer="{}"))
    assert refused == "BLOCK q"
    assert await meta(redis, keys, eid) == before
    assert await redis.exists(keys.state(eid)) == 0


@pytest.mark.parametrize("handoff_only", [False, True])
async def test_lease_refuses_a_takeover_while_the_owner_holds_it(
    redis: Redis, keys: Keys, eid: str, handoff_only: bool
) -> None:
    """A live lease, or (handoff_only) any lease at all unless it was handed off."""
    await execution(redis, keys, eid, leaseUntil=0 if handoff_only else FAR)
    before = await meta(redis, keys, eid)
    refused = await refusal(
        claim(redis, keys, eid, "takeover", argument=OWNER, handoff_only=handoff_only)
    )
    assert refused == "LEASE"
    assert await meta(redis, keys, eid) == before


@pytest.mark.parametrize(
    ("fields", "mode", "token", "expected"),
    [
        ({"leaseUntil": 0}, "takeover", NEW, "node-c:3333"),
        ({"owner": "", "handoff": OWNER, "leaseUntil": 0}, "takeover", NEW, "node-c:3333"),
        ({}, "handoff", NEW, ""),
    ],
    ids=["expired-lease-of-another", "handed-off-by-another", "handoff-by-a-non-owner"],
)
async def test_moved_when_the_execution_has_another_owner_than_expected(
    redis: Redis,
    keys: Keys,
    eid: str,
    fields: dict[str, Any],
    mode: str,
    token: str,
    expected: str,
) -> None:
    await execution(redis, keys, eid, **fields)
    before = await meta(redis, keys, eid)
    assert await refusal(claim(redis, keys, eid, mode, token, argument=expected)) == "MOVED"
    assert await meta(redis, keys, eid) == before


@pytest.mark.parametrize("deadline", [FAR, None])
async def test_notdue_before_the_deadline_or_without_one(
    redis: Redis, keys: Keys, eid: str, deadline: int | None
) -> None:
    fields = {} if deadline is None else {"pauseDeadline": deadline}
    await execution(redis, keys, eid, status="paused", pauseBlock="q", **fields)
    before = await meta(redis, keys, eid)
    assert await refusal(claim(redis, keys, eid, "expire")) == "NOTDUE"
    assert await meta(redis, keys, eid) == before


async def test_mode_names_a_transition_there_is_not(redis: Redis, keys: Keys, eid: str) -> None:
    await execution(redis, keys, eid)
    before = await meta(redis, keys, eid)
    assert await refusal(claim(redis, keys, eid, "adopt")) == "MODE adopt"
    assert await meta(redis, keys, eid) == before


# -- blame: who a death is charged to (ARGV[8]), one suspect per process (ARGV[9]) ------


@pytest.mark.parametrize(
    ("verdict", "crashes", "reason", "quarantined"),
    [
        ("", "2", b"worker_lost", None),
        ("alone", "2", b"worker_lost", None),
        ("beside", "1", b"worker_lost", None),
        ("crowd", "1", b"worker_lost", None),
        ("suspect", "2", b"quarantined", "1"),
    ],
)
async def test_a_death_is_charged_as_its_verdict_says_and_counted_whatever_it_is(
    redis: Redis, keys: Keys, eid: str, verdict: str, crashes: str, reason: bytes,
    quarantined: str | None,
) -> None:  # fmt: skip
    """Every death of its owner counts in ``deaths``; only one it ran alone through, or
    as its process's suspect, is charged (``crashes``); a suspect's is its quarantine."""
    await execution(redis, keys, eid, leaseUntil=0, recoveries=1, crashes=1, deaths=1)
    reply = await claim(redis, keys, eid, "takeover", argument=OWNER, verdict=verdict)
    assert reply[6:] == [reason, int(crashes), b"0", 2]
    stored = await meta(redis, keys, eid)
    assert (stored["crashes"], stored["deaths"], stored.get("quarantined")) == (
        crashes, "2", quarantined,
    )  # fmt: skip


async def test_a_quarantined_execution_says_so_at_every_later_takeover(
    redis: Redis, keys: Keys, eid: str
) -> None:
    """Its quarantine holds when the owner that was to end it died, or handed it off,
    and a busy caller may take it (it only ends)."""
    await execution(redis, keys, eid, leaseUntil=0, deaths=2, quarantined="1")
    reply = await claim(redis, keys, eid, "takeover", argument=OWNER, verdict="crowd", busy=True)
    assert reply[6] == b"quarantined"
    await execution(redis, keys, eid, owner="", handoff=NEW, leaseUntil=0, epoch=3)
    again = await claim(redis, keys, eid, "takeover", "node-c:3", argument=NEW, busy=True)
    assert again[6] == b"quarantined"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"leaseUntil": 0, "deaths": 1}, OWNER),  # its owner died now, a second time
        ({"owner": "", "handoff": OWNER, "leaseUntil": 0, "deaths": 2}, OWNER),  # before
    ],
)
async def test_suspect_refuses_a_second_suspect_to_a_process_that_runs_one(
    redis: Redis, keys: Keys, eid: str, fields: dict[str, Any], expected: str
) -> None:
    await execution(redis, keys, eid, **fields)
    before = await meta(redis, keys, eid)
    assert await refusal(claim(redis, keys, eid, "takeover", argument=expected, busy=True)) == (
        "SUSPECT"
    )
    assert await meta(redis, keys, eid) == before


@pytest.mark.parametrize(
    "fields",
    [
        {"leaseUntil": 0},  # its owner died now, the first time
        {"owner": "", "handoff": OWNER, "leaseUntil": 0, "deaths": 1},  # once, before
    ],
)
async def test_one_death_makes_no_suspect_so_a_busy_caller_takes_it_over(
    redis: Redis, keys: Keys, eid: str, fields: dict[str, Any]
) -> None:
    """A replica lost for any reason leaves its runs one death each: they are taken over
    at once, whatever suspect the takers run (blame.py SUSPECT_DEATHS)."""
    await execution(redis, keys, eid, **fields)
    reply = await claim(redis, keys, eid, "takeover", argument=OWNER, busy=True)
    assert reply[3] == NEW.encode()


async def test_a_busy_caller_takes_over_a_hand_off_of_a_run_that_never_died(
    redis: Redis, keys: Keys, eid: str
) -> None:
    await execution(redis, keys, eid, owner="", handoff=OWNER, leaseUntil=0)
    reply = await claim(redis, keys, eid, "takeover", argument=OWNER, busy=True)
    assert reply[6:] == [b"handoff", 0, b"0", 0]


@pytest.mark.timeout(30)
async def test_a_revoked_takers_take_is_refused_however_late_and_only_its(
    redis: Redis, keys: Keys
) -> None:
    """ "revoke" fences a taker out before its record exists too (a start's record comes
    a round trip after its line's entry): its take, when it comes, is refused REVOKED,
    writing nothing, while another taker's take wins; a revoke once it runs is STATUS."""
    eid = "ex-revoked"
    assert await claim(redis, keys, eid, "revoke", token="node-w:1") == 0  # no record yet
    assert not await redis.exists(keys.meta(eid)), "a revoke creates no record"
    ttl = await redis.pttl(keys.revoked(eid))
    assert 0 < ttl <= LEASE_MS
    await redis.hset(keys.meta(eid), mapping={"status": "queued", "owner": "", "epoch": 0})
    assert await claim(redis, keys, eid, "revoke", token="node-w:2") == 1
    before = await meta(redis, keys, eid)
    for late in ("node-w:1", "node-w:2"):
        assert await refusal(claim(redis, keys, eid, "take", token=late)) == "REVOKED"
    assert await meta(redis, keys, eid) == before
    await claim(redis, keys, eid, "take", token="node-w:3")
    assert (await meta(redis, keys, eid))["owner"] == "node-w:3"
    revoked = await refusal(claim(redis, keys, eid, "revoke", token="node-w:3"))
    assert revoked == "STATUS running"
