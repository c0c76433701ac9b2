"""Breaking step 11 (durable execution) with faults on real processes.

Each test is a scenario a fresh pair of eyes tried against SPEC §4, §5, §7: replicas
share one Valkey (lease 1 s, grace 1 s); faults are SIGKILL / SIGTERM of replicas and
Valkey restarted from an older snapshot or empty. Every stored log goes through
tests/support/logcheck.py, every client view through ``check_view``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import all_events, put
from tests.support.faults import (
    LEASE_SECONDS,
    FaultyValkey,
    crash_and_restore,
    crash_and_wipe,
    fresh_replica,
    kill_replica,
    pause_writes,
    replica,
    take_snapshot,
    terminate_replica,
    wait_store_settled,
)
from tests.support.logcheck import check_log, check_lossy_log, check_view
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame, events

pytestmark = pytest.mark.timeout(150)

DEADLINE = 40.0


@pytest.fixture(scope="module")
async def valkey(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FaultyValkey]:
    server = FaultyValkey(data_dir=tmp_path_factory.mktemp("break11-valkey"))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(autouse=True)
async def settled(valkey: FaultyValkey) -> None:
    """Start each test on a settled store, and with no leftover ownership from an
    earlier test (its replicas are dead: their executions must not be recovered here)."""
    await wait_store_settled(valkey, timeout=DEADLINE, flush=True)


@contextlib.asynccontextmanager
async def running(*servers: FlowcastServer) -> AsyncIterator[list[FlowcastServer]]:
    """Start the servers; SIGKILL whatever is still up at the end (extras appended too)."""
    alive = list(servers)
    try:
        await asyncio.gather(*(server.start() for server in servers))
        yield alive
    finally:
        await asyncio.gather(*(s.stop(signal.SIGKILL) for s in alive), return_exceptions=True)


def chain(workflow_id: str, *, blocks: int, ms: int) -> dict[str, Any]:
    """s0 → s1 → … (delays), then ``end`` echoing s0's output."""
    ids = [f"s{index}" for index in range(blocks)]
    definition: list[dict[str, Any]] = [
        {"id": block_id, "type": "delay", "config": {"ms": ms}} for block_id in ids
    ]
    definition.append(
        {"id": "end", "type": "transform", "config": {"value": "{{ blocks.s0.output }}"}}
    )
    edges = [{"from": a, "to": b} for a, b in zip(ids, [*ids[1:], "end"], strict=True)]
    return {"id": workflow_id, "blocks": definition, "edges": edges}


async def execute(client: httpx.AsyncClient, workflow_id: str, input: Any = None) -> str:
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": input})
    assert response.status_code == 202, response.text
    return str(response.json()["executionId"])


async def until(check: Any, what: str, timeout: float = DEADLINE) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for: {what}") from None


async def snapshot_of(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/executions/{execution_id}")
    return dict(response.json())


async def finished(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    result: dict[str, Any] = {}

    async def done() -> bool:
        nonlocal result
        with contextlib.suppress(httpx.TransportError):
            response = await client.get(f"/api/executions/{execution_id}")
            if response.status_code == 200:
                result = response.json()
                return result["status"] in ("completed", "failed", "cancelled")
        return False

    await until(done, f"{execution_id} finished (last seen {result})")
    return result


async def has_event(
    client: httpx.AsyncClient, execution_id: str, kind: str, block: str = ""
) -> bool:
    with contextlib.suppress(httpx.TransportError, KeyError):  # KeyError: a 404 page
        for event in await all_events(client, execution_id):
            if event["type"] == kind and (not block or event["data"].get("blockId") == block):
                return True
    return False


async def follow(client: httpx.AsyncClient, execution_id: str, cursor: int = 0) -> list[Frame]:
    """Read a stream to its end (it must end), on the replica ``client`` talks to."""
    url = f"/api/executions/{execution_id}/stream"
    async with asyncio.timeout(DEADLINE):
        async with client.stream("GET", url, headers={"Last-Event-ID": str(cursor)}) as response:
            if response.status_code == 204:
                return []
            assert response.status_code == 200, await response.aread()
            return [frame async for frame in events(response)]


async def follow_on(server: FlowcastServer, execution_id: str) -> list[Frame]:
    """``follow`` with a client of its own, closed after (its socket would otherwise be
    left for the garbage collector, and warn in whichever test it runs in)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        return await follow(client, execution_id)


def check_recovered(stored: list[dict[str, Any]], *, moves: int | None = None) -> None:
    """As test_recovery.check_recovered_run: contiguous, one terminal event, each block
    completed once, each recovery numbered 1, 2, … and kept blocks never run again."""
    check_log(stored)
    completed = [e["data"]["blockId"] for e in stored if e["type"] == "block:completed"]
    assert len(completed) == len(set(completed)), f"a block completed twice: {completed}"
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    if moves is not None:
        assert len(recovered) == moves, [e["data"] for e in recovered]
    for number, event in enumerate(recovered, start=1):
        assert event["data"]["recovery"] == number, [e["data"] for e in recovered]
        kept = set(event["data"]["completed"])
        before = {
            e["data"]["blockId"]
            for e in stored
            if e["type"] == "block:completed" and e["id"] < event["id"]
        }
        assert kept == before, (kept, before)
        later = {
            e["data"]["blockId"]
            for e in stored
            if e["type"] == "block:started" and e["id"] > event["id"]
        }
        assert not kept & later, f"kept blocks ran again: {kept & later}"


# -- 1. two replicas SIGTERMed at once, then a new one --------------------------------


async def test_both_replicas_sigtermed_at_once_then_a_new_one_finishes_everything(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A rolling restart gone wrong: both replicas get SIGTERM together. Each hands its
    executions off; the other is shutting down and must not take them (or must hand them
    off again). A replica started afterwards must finish every one, none failed."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        # The drain starts no new block: every run is handed off with blocks left.
        wf = chain("both", blocks=4, ms=500)
        await put(http_for(http, a), wf)
        started = [await execute(http_for(http, a), "both") for _ in range(4)]
        started += [await execute(http_for(http, b), "both") for _ in range(4)]

        async def all_running() -> bool:
            return all(
                [await has_event(http_for(http, a), eid, "block:started") for eid in started]
            )

        await until(all_running, "every execution runs a block")
        codes = await asyncio.gather(terminate_replica(a), terminate_replica(b))
        assert all(code in (0, -signal.SIGTERM) for code in codes), codes
        c = await fresh_replica(a)
        alive.append(c)
        statuses = [(await finished(http_for(http, c), eid))["status"] for eid in started]
        logs = [await all_events(http_for(http, c), eid) for eid in started]
    assert statuses == ["completed"] * len(started), statuses
    for stored in logs:
        check_recovered(stored)
        assert stored[-1]["data"]["output"] == {"end": {"waitedMs": 500}}


def http_for(client: httpx.AsyncClient, server: FlowcastServer) -> httpx.AsyncClient:
    client.base_url = httpx.URL(server.url)
    return client


# -- 2. double crash: the replica that just took over is SIGKILLed too ----------------


async def test_the_replica_that_took_over_is_killed_too_and_a_third_finishes(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("dbl", blocks=4, ms=600))  # B dies within s1
        eid = await execute(http_for(http, a), "dbl")
        reader = asyncio.create_task(follow_on(b, eid))
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        await kill_replica(a)
        await until(lambda: has_event(http_for(http, b), eid, "execution:recovered"), "B took over")
        await kill_replica(b)
        c = await fresh_replica(a)
        alive.append(c)
        snapshot = await finished(http_for(http, c), eid)
        stored = await all_events(http_for(http, c), eid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader, 1)
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=2)


async def test_the_new_owner_killed_right_after_its_claim_still_numbers_recoveries_1_2(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Kill the replica that took over the instant its claim is in Redis (before it
    stored its execution:recovered). The next recovery must still be told apart: each
    recovery emits exactly one execution:recovered, numbered 1, 2, …"""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    redis = Redis.from_url(valkey.url)
    try:
        async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
            await put(http_for(http, a), chain("claimkill", blocks=2, ms=600))
            eid = await execute(http_for(http, a), "claimkill")
            await until(lambda: has_event(http_for(http, b), eid, "block:started"), "started")
            await kill_replica(a)

            async def claimed() -> bool:
                return await redis.hget(f"fc:{{{eid}}}:meta", "recoveries") == b"1"

            async with asyncio.timeout(DEADLINE):
                while not await claimed():
                    pass  # as tight as a loop can: kill B right after its claim
            await kill_replica(b)
            c = await fresh_replica(a)
            alive.append(c)
            snapshot = await finished(http_for(http, c), eid)
            stored = await all_events(http_for(http, c), eid)
    finally:
        await redis.aclose()
    assert snapshot["status"] == "completed", snapshot
    recovered = [e["data"]["recovery"] for e in stored if e["type"] == "execution:recovered"]
    check_log(stored)
    assert recovered == list(range(1, len(recovered) + 1)), (
        f"recovery numbers in the log: {recovered}"
    )


# -- 3. the store loses the checkpoint of a running execution, then it is handed off ---


async def test_a_handoff_after_redis_came_back_empty_does_not_fail_the_execution(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Redis restarts empty while A runs an execution; A recreates its log and carries on
    (step 9). Then A is SIGTERMed: a shutdown hands work off, it does not fail it; A
    still holds everything the run needs in memory (workflow, input, outputs)."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = chain("wiped", blocks=8, ms=400)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), "wiped", {"who": "x"})
        await until(lambda: has_event(http_for(http, a), eid, "block:completed", "s1"), "s1")
        await crash_and_wipe(valkey)
        await put(http_for(http, a), wf)
        # A recreates the execution in the empty store as it goes on.
        await until(lambda: has_event(http_for(http, a), eid, "block:completed"), "recreated")
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        await terminate_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    assert snapshot["status"] == "completed", (snapshot.get("error"), [e["type"] for e in stored])
    check_lossy_log(stored, dropped=[(1, max(e["id"] for e in stored))])


async def settled_store(valkey: FaultyValkey) -> bool:
    """The server answering now was noticed (fc:store names its run id) and the settle
    window after the change is over: owners had their time to re-assert."""
    redis = Redis.from_url(valkey.url)
    try:
        with contextlib.suppress(Exception):
            info = await redis.info("server")
            run_id, until_ms = await redis.hmget("fc:store", ["runId", "settleUntil"])
            seconds, micros = await redis.time()
            return (
                run_id is not None
                and run_id.decode() == str(info["run_id"])
                and int(until_ms or 0) <= seconds * 1000 + micros // 1000
            )
        return False
    finally:
        await redis.aclose()


async def test_blocks_completed_after_an_older_snapshot_are_not_run_again_after_a_handoff(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Redis comes back from an older snapshot while A runs: the checkpoint loses the
    outputs of the blocks that completed since (clients saw their block:completed). A
    goes on with them in memory. Then A hands the execution off: B must not run again a
    block whose completion clients saw (SPEC §7: completed blocks are not run again)."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        # Long enough to be running still when A is stopped, after the store settled.
        wf = chain("older", blocks=16, ms=500)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), "older")
        live = asyncio.create_task(follow_on(a, eid))
        await until(lambda: has_event(http_for(http, a), eid, "block:completed", "s0"), "s0")
        snap = await take_snapshot(valkey, tmp_path / "older.rdb")
        await until(lambda: has_event(http_for(http, a), eid, "block:completed", "s2"), "s2")
        await crash_and_restore(valkey, snap)
        await until(lambda: settled_store(valkey), "the store settled", timeout=20)
        await terminate_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(live, 2)
    assert snapshot["status"] == "completed", snapshot
    seen = check_view(live.result()) if live.done() and not live.exception() else []
    seen_completed = {e["data"]["blockId"] for e in seen if e["type"] == "block:completed"} | {
        "s0",
        "s1",
        "s2",
    }
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    assert len(recovered) == 1, recovered
    rerun_after = [
        e["data"]["blockId"]
        for e in stored
        if e["type"] == "block:started" and e["id"] > recovered[0]["id"]
    ]
    again = sorted(set(rerun_after) & {"s1", "s2"})
    assert not again, (
        f"blocks whose block:completed clients saw (and A kept) ran again after the "
        f"hand-off: {again}; recovered data {recovered[0]['data']}; "
        f"seen completed live {sorted(seen_completed)}"
    )


# -- 4. cancel racing a hand-off / a takeover ----------------------------------------


async def test_a_cancel_accepted_while_the_execution_is_handed_off_ends_it_cancelled(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A hands off at SIGTERM; a cancel lands on B at the instant the execution has no
    owner (owner "", handoff set). The 202 must take effect: ends ``cancelled``."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    redis = Redis.from_url(valkey.url)
    try:
        async with running(a, b), httpx.AsyncClient(timeout=30) as http:
            await put(http_for(http, a), chain("cxho", blocks=6, ms=500))
            eid = await execute(http_for(http, a), "cxho")
            await until(lambda: has_event(http_for(http, b), eid, "block:started"), "started")
            stopping = asyncio.create_task(terminate_replica(a))

            async def handed() -> bool:
                return bool(await redis.hexists(f"fc:{{{eid}}}:meta", "handoff"))

            async with asyncio.timeout(DEADLINE):
                while not await handed():
                    pass
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
                cancel = await on_b.post(f"/api/executions/{eid}/cancel")
                await stopping
                snapshot = await finished(on_b, eid)
                stored = await all_events(on_b, eid)
                view = await follow(on_b, eid)
    finally:
        await redis.aclose()
    assert cancel.status_code == 202, cancel.text
    assert snapshot["status"] == "cancelled", (snapshot, [e["type"] for e in stored])
    check_log(stored)
    assert check_view(view) == stored


async def test_a_cancel_of_a_crashed_execution_racing_its_takeover_ends_it_cancelled(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("cxto", blocks=6, ms=500))
        results = []
        for turn in range(3):
            eid = await execute(http_for(http, a), "cxto")
            await until(lambda e=eid: has_event(http_for(http, b), e, "block:started"), "started")
            await kill_replica(a)
            await asyncio.sleep(LEASE_SECONDS * 0.9)  # the fault timing: around lease end
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
                cancel = await on_b.post(f"/api/executions/{eid}/cancel")
                snapshot = await finished(on_b, eid)
                stored = await all_events(on_b, eid)
            results.append((cancel.status_code, snapshot["status"], [e["type"] for e in stored]))
            check_log(stored)
            if turn < 2:  # A again for the next turn
                await a.start()
    for code, status, types in results:
        assert code == 202, (code, status)
        assert status == "cancelled", (status, types)


# -- 5. resume racing a SIGTERM ---------------------------------------------------------


def approval_flow(workflow_id: str, *, before_ms: int = 0, after_ms: int = 0) -> dict[str, Any]:
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "wait", "type": "delay", "config": {"ms": before_ms}},
            {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": schema}},
            {"id": "after", "type": "delay", "config": {"ms": after_ms}},
            {"id": "echo", "type": "transform", "config": {"value": "{{ blocks.review.output }}"}},
        ],
        "edges": [
            {"from": "wait", "to": "review"},
            {"from": "review", "to": "after"},
            {"from": "after", "to": "echo"},
        ],
    }


async def test_a_resume_accepted_as_its_replica_gets_sigterm_takes_effect_elsewhere(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), approval_flow("rsterm", after_ms=1500))
        eid = await execute(http_for(http, a), "rsterm")
        await until(
            lambda: _status_is(http_for(http, a), eid, "paused"), "paused", timeout=DEADLINE
        )
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a:
            resume = await on_a.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
        code = await terminate_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
    assert resume.status_code == 202, resume.text
    assert code in (0, -signal.SIGTERM)
    assert snapshot["status"] == "completed", (snapshot, [e["type"] for e in stored])
    check_recovered(stored)
    assert snapshot["output"] == {"echo": {"ok": True}}
    review_starts = [
        e for e in stored if e["type"] == "block:started" and e["data"]["blockId"] == "review"
    ]
    assert [e["type"] for e in stored].count("execution:resumed") == 1
    assert len(review_starts) <= 2, review_starts


async def _status_is(client: httpx.AsyncClient, execution_id: str, status: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return bool((await snapshot_of(client, execution_id))["status"] == status)
    return False


async def test_an_approval_after_a_recovery_pauses_and_resumes_once(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), approval_flow("aprec", before_ms=1500))
        eid = await execute(http_for(http, a), "aprec")
        await until(lambda: has_event(http_for(http, b), eid, "block:started", "wait"), "wait")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            await until(lambda: _status_is(on_b, eid, "paused"), "paused after recovery")
            resume = await on_b.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
            again = await on_b.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
    assert resume.status_code == 202, resume.text
    assert again.status_code == 409, again.text
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=1)
    assert snapshot["output"] == {"echo": {"ok": True}}


async def test_a_paused_execution_resumed_then_its_runner_killed_completes_and_answer_kept(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Resume (202) on A, A is SIGKILLed while the block after the approval runs: B
    recovers; the answered approval does not pause again and the answer reaches echo."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), approval_flow("rskill", after_ms=1500))
        eid = await execute(http_for(http, a), "rskill")
        async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a:
            await until(lambda: _status_is(on_a, eid, "paused"), "paused")
            resume = await on_a.post(f"/api/executions/{eid}/resume", json={"input": {"ok": True}})
            await until(lambda: has_event(on_a, eid, "block:started", "after"), "after runs")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
    assert resume.status_code == 202
    assert snapshot["status"] == "completed", (snapshot, [e["type"] for e in stored])
    check_recovered(stored, moves=1)
    assert snapshot["output"] == {"echo": {"ok": True}}
    assert [e["type"] for e in stored].count("execution:paused") == 1


# -- 6. retries across a recovery ------------------------------------------------------


async def test_retries_across_a_recovery_continue_the_attempts_and_keep_the_budget(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A block with retry.attempts = 3 fails attempt 1 and waits its backoff; the owner
    dies meanwhile. The recovery runs the next attempt (2): numbers continue, no
    attempt number is used twice, and the block is not given a fresh budget of 3."""
    env = {"FLOWCAST_PLUGINS": "tests.support.plugins"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    workflow = {
        "id": "retries",
        "blocks": [
            {
                "id": "talk",
                "type": "python",
                "config": {"name": "flaky", "args": {"words": 2, "succeedOn": 9}},
                "retry": {"attempts": 3, "backoffMs": 2500},
            }
        ],
        "edges": [],
    }
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), workflow)
        eid = await execute(http_for(http, a), "retries")
        await until(lambda: has_event(http_for(http, b), eid, "block:failed"), "attempt 1 failed")
        await kill_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    check_log(stored)
    starts = [e["data"]["attempt"] for e in stored if e["type"] == "block:started"]
    failures = [
        (e["data"]["attempt"], e["data"]["willRetry"])
        for e in stored
        if e["type"] == "block:failed"
    ]
    assert starts == sorted(set(starts)) and starts[0] == 1, starts
    assert snapshot["status"] == "failed", snapshot
    assert len(starts) <= 3, (
        f"retry.attempts is 3 but the block ran {len(starts)} attempts {starts}; "
        f"failures {failures}"
    )


# -- 7. large outputs across a recovery --------------------------------------------------


async def test_recovered_outputs_kept_as_refs_feed_downstream_templates(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    # One value store for both (as S3 would be in production): a shared data dir.
    env = {
        "FLOWCAST_EVENT_BUDGET_BYTES": "200000",
        "FLOWCAST_EVENT_LIMIT": "50",
        "FLOWCAST_DATA_DIR": str(tmp_path / "shared"),
    }
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    workflow = {
        "id": "bigrec",
        "blocks": [
            {"id": "big", "type": "payload", "config": {"bytes": 150_000, "shape": "array"}},
            {"id": "mid", "type": "payload", "config": {"bytes": 30_000}},
            {"id": "obj", "type": "payload", "config": {"bytes": 60_000, "shape": "object"}},
            {"id": "wait", "type": "delay", "config": {"ms": 1500}},
            {
                "id": "use",
                "type": "transform",
                "config": {
                    "value": {
                        "n": "{{ blocks.big.output | length }}",
                        "m": "{{ blocks.mid.output | length }}",
                        "k": "{{ blocks.obj.output | length }}",
                        "head": "{{ blocks.mid.output[:5] }}",
                    }
                },
            },
        ],
        "edges": [
            {"from": "big", "to": "mid"},
            {"from": "mid", "to": "obj"},
            {"from": "obj", "to": "wait"},
            {"from": "wait", "to": "use"},
        ],
    }
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), workflow)
        eid = await execute(http_for(http, a), "bigrec")
        await until(lambda: has_event(http_for(http, b), eid, "block:started", "wait"), "waiting")
        await kill_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
        view = await follow(http_for(http, b), eid)
    check_lossy_log(stored)
    check_view(view)
    assert snapshot["status"] == "completed", (snapshot.get("error"), stored[-1])
    recovered = [e for e in stored if e["type"] == "execution:recovered"]
    assert len(recovered) == 1 and recovered[0]["data"]["completed"] == ["big", "mid", "obj"], (
        recovered
    )
    # The recovered checkpoint really held refs into the value store.
    outputs = [e["data"]["output"] for e in stored if e["type"] == "block:completed"]
    assert any(isinstance(o, dict) and o.get("$ref") == "value" for o in outputs), outputs
    assert snapshot["output"]["use"] == {
        "n": 146,
        "m": 29_998,
        "k": 58,
        "head": "abcde",
    }, snapshot["output"]


# -- 8. MAX_RECOVERIES=0 and a SIGTERM ------------------------------------------------------


async def test_recovery_off_still_hands_off_at_sigterm(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    env = {"FLOWCAST_MAX_RECOVERIES": "0"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("norec", blocks=4, ms=500))
        eid = await execute(http_for(http, a), "norec")
        await until(lambda: has_event(http_for(http, b), eid, "block:started"), "started")
        await terminate_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=1)


# -- 9. parallel branches killed mid-flight --------------------------------------------------


async def test_parallel_branches_killed_mid_flight_rerun_only_the_unfinished(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    blocks: list[dict[str, Any]] = [{"id": "root", "type": "transform", "config": {"value": 1}}]
    edges = []
    for index in range(6):
        blocks.append({"id": f"p{index}", "type": "delay", "config": {"ms": 200 + 500 * index}})
        edges.append({"from": "root", "to": f"p{index}"})
    blocks.append(
        {"id": "join", "type": "transform", "config": {"value": "{{ blocks.p5.output }}"}}
    )
    edges += [{"from": f"p{index}", "to": "join"} for index in range(6)]
    workflow = {"id": "par", "blocks": blocks, "edges": edges}
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), workflow)
        eid = await execute(http_for(http, a), "par")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "p1"), "p1 done")
        await kill_replica(a)
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
        view = await follow(http_for(http, b), eid)
    assert snapshot["status"] == "completed", snapshot
    check_recovered(stored, moves=1)
    assert check_view(view) == stored
    recovered = next(e for e in stored if e["type"] == "execution:recovered")
    kept = set(recovered["data"]["completed"])
    rerun = set(recovered["data"]["rerun"])
    assert {"root", "p0", "p1"} <= kept, recovered["data"]
    assert not kept & rerun


# -- 10. handed off with nobody left, then cancel on a new replica ----------------------------


async def test_handed_off_with_nobody_alive_then_a_new_replica_and_a_cancel(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """The only replica is SIGTERMed: its execution waits handed off. A new replica
    starts and a cancel arrives at once: the 202 wins, the execution ends cancelled."""
    only = replica(valkey, tmp_path, "only")
    async with running(only) as alive, httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, only), chain("alone", blocks=6, ms=800))
        eid = await execute(http_for(http, only), "alone")
        await until(lambda: has_event(http_for(http, only), eid, "block:started"), "started")
        await terminate_replica(only)
        again = await fresh_replica(only)
        alive.append(again)
        cancel = await http_for(http, again).post(f"/api/executions/{eid}/cancel")
        snapshot = await finished(http_for(http, again), eid)
        stored = await all_events(http_for(http, again), eid)
    assert cancel.status_code == 202, cancel.text
    assert snapshot["status"] == "cancelled", (snapshot, [e["type"] for e in stored])
    check_log(stored)


# -- 11. the store forgets a recovery -----------------------------------------------------


async def test_a_store_restored_from_before_a_recovery_does_not_number_recoveries_again(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """A runs; a snapshot is taken; A is SIGKILLed and B recovers it (recovery 1, stored
    and seen live). Redis then comes back from the snapshot, from before the recovery:
    B takes its execution back (epoch above the stored one). B is later SIGTERMed and a
    third replica recovers it: that is recovery 2, never a second "recovery 1"; and no
    id a client saw names another event."""
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b) as alive, httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("forgot", blocks=12, ms=400))
        eid = await execute(http_for(http, a), "forgot")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        snap = await take_snapshot(valkey, tmp_path / "before-recovery.rdb")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            live = asyncio.create_task(follow(on_b, eid))
            await until(lambda: has_event(on_b, eid, "execution:recovered"), "B recovered")
            await until(lambda: has_event(on_b, eid, "block:completed", "s3"), "s3 on B")
            await crash_and_restore(valkey, snap)
            await put(on_b, chain("forgot", blocks=12, ms=400))
            await until(lambda: settled_store(valkey), "the store settled", timeout=20)
            await until(lambda: has_event(on_b, eid, "block:completed", "s6"), "s6 on B")
            c = await fresh_replica(a)
            alive.append(c)
            await terminate_replica(b)
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as on_c:
            snapshot = await finished(on_c, eid)
            stored = await all_events(on_c, eid)
            replay = await follow(on_c, eid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(live, 2)
    assert snapshot["status"] == "completed", (snapshot.get("error"), stored[-1])
    check_lossy_log(stored, dropped=_dropped_ranges(replay))
    check_view(replay)
    if live.done() and not live.exception():
        seen = check_view(live.result())
        by_id = {e["id"]: e for e in stored}
        for envelope in seen:
            if envelope["id"] in by_id:
                assert by_id[envelope["id"]] == envelope, (envelope, by_id[envelope["id"]])
        seen_recoveries = [e["data"] for e in seen if e["type"] == "execution:recovered"]
    else:
        seen_recoveries = []
    recoveries = [e["data"] for e in stored if e["type"] == "execution:recovered"]
    numbers = [r["recovery"] for r in seen_recoveries] + [
        r["recovery"] for r in recoveries if r not in seen_recoveries
    ]
    assert len(numbers) == len(set(numbers)), (
        f"two recoveries with the same number: seen live {seen_recoveries}, stored {recoveries}"
    )


def _dropped_ranges(frames: list[Frame]) -> list[tuple[int, int]]:
    gaps = [frame.json for frame in frames if frame.event == "replay:gap"]
    return [(gap["after"] + 1, gap["resumeAt"] - 1) for gap in gaps]


async def test_redis_restarted_empty_right_after_a_takeover_still_completes(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a, b = replica(valkey, tmp_path, "a"), replica(valkey, tmp_path, "b")
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        wf = chain("wiperec", blocks=6, ms=500)
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), "wiperec")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
            live = asyncio.create_task(follow(on_b, eid))
            await until(lambda: has_event(on_b, eid, "execution:recovered"), "B recovered")
            await crash_and_wipe(valkey)
            await put(on_b, wf)
            snapshot = await finished(on_b, eid)
            stored = await all_events(on_b, eid)
            seen = check_view(await live)
    assert snapshot["status"] == "completed", (snapshot.get("error"), stored)
    assert seen[-1]["type"] == "execution:completed"
    by_id = {e["id"]: e for e in stored}
    for envelope in seen:
        if envelope["id"] in by_id:
            assert by_id[envelope["id"]] == envelope


async def test_writes_paused_across_a_handoff_still_hand_off_and_complete(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """CLIENT PAUSE WRITE (2 s) lands as A is SIGTERMed: A's drain, hand-off claim and
    renewals all wait. It is still a hand-off (not a crash): with recovery from crashes
    turned off (FLOWCAST_MAX_RECOVERIES=0) it must complete, not end worker_lost."""
    env = {"FLOWCAST_MAX_RECOVERIES": "0"}
    a, b = replica(valkey, tmp_path, "a", **env), replica(valkey, tmp_path, "b", **env)
    async with running(a, b), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), chain("pausedho", blocks=6, ms=500))
        eid = await execute(http_for(http, a), "pausedho")
        await until(lambda: has_event(http_for(http, b), eid, "block:completed", "s0"), "s0")
        stopping = asyncio.create_task(terminate_replica(a))
        await pause_writes(valkey, 2000)
        await stopping
        snapshot = await finished(http_for(http, b), eid)
        stored = await all_events(http_for(http, b), eid)
    assert snapshot["status"] == "completed", (snapshot.get("error"), [e["type"] for e in stored])
    check_recovered(stored, moves=1)
