"""Faults on real processes (SPEC §3, §4, §5, §7): nothing stuck, no 202 that does
nothing, no id that names two events.

Two Flowcast processes (A and B, lease 1 s) share one Valkey; faults come from Valkey
itself (``CLIENT PAUSE … WRITE``, kill -9 and restart from an older snapshot or empty)
or from a seam (a replica whose clock runs 60 s ahead).
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

from tests.support.api import all_events, put, talking_workflow, until, wait_status, within
from tests.support.faults import (
    FaultyValkey,
    crash_and_restart,
    crash_and_restore,
    crash_and_wipe,
    pause_writes,
    replica,
    take_snapshot,
    wait_store_settled,
)
from tests.support.logcheck import TERMINAL, check_view
from tests.support.recovery import has_event
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame, events, follow
from tests.support.timing import hold_for

TERMINAL_STATUSES = ("completed", "failed", "cancelled")
# Every stream on an execution ends within about a lease plus the grace: far below this.
STREAM_DEADLINE = 20.0


@pytest.fixture(scope="module")
async def valkey(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FaultyValkey]:
    # Durable: these tests kill Valkey and expect nothing it acknowledged to be lost. With
    # the default everysec, a busy disk let a kill lose an acknowledged resume (its
    # claim and its execution:resumed) in one clean-clone run; that is a store come back
    # behind, which tests/e2e/recovery/test_store_loss.py covers.
    server = FaultyValkey(data_dir=tmp_path_factory.mktemp("faults-valkey"), durable=True)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(autouse=True)
async def settled(valkey: FaultyValkey) -> None:
    """Each test starts on a settled store: right after an earlier test restarted it,
    claims answer 503 for two leases by design (see lib/execution/store.py)."""
    await wait_store_settled(valkey, timeout=STREAM_DEADLINE)


@pytest.fixture(scope="module")
async def pair(
    valkey: FaultyValkey, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    root = tmp_path_factory.mktemp("faults")
    servers = (replica(valkey, root, "a"), replica(valkey, root, "b"))
    await asyncio.gather(*(server.start() for server in servers))
    yield servers
    await asyncio.gather(*(server.stop(signal.SIGKILL) for server in servers))


@contextlib.asynccontextmanager
async def clients(
    pair: tuple[FlowcastServer, FlowcastServer],
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with (
        httpx.AsyncClient(base_url=pair[0].url, timeout=30) as a,
        httpx.AsyncClient(base_url=pair[1].url, timeout=30) as b,
    ):
        yield a, b


async def execute(client: httpx.AsyncClient, workflow_id: str, input: Any = None) -> str:
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": input})
    assert response.status_code == 202, response.text
    execution_id: str = response.json()["executionId"]
    return execution_id


def approval_workflow(workflow_id: str, *, wait_ms: int = 0) -> dict[str, Any]:
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "wait", "type": "delay", "config": {"ms": wait_ms}},
            {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": schema}},
            {"id": "after", "type": "transform", "config": {"value": "{{ blocks.review.output }}"}},
        ],
        "edges": [{"from": "wait", "to": "review"}, {"from": "review", "to": "after"}],
    }


def same_events(seen: list[dict[str, Any]], stored: list[dict[str, Any]]) -> None:
    """No id names two different events: every id a client saw is the stored event."""
    by_id = {envelope["id"]: envelope for envelope in stored}
    for envelope in seen:
        if envelope["id"] in by_id:
            assert by_id[envelope["id"]] == envelope, (envelope, by_id[envelope["id"]])


def covered(stored: list[dict[str, Any]], frames: list[Frame]) -> None:
    """A full replay is the stored log: ids in order, holes only behind a replay:gap."""
    envelopes = check_view(frames)
    assert [e["id"] for e in envelopes] == [e["id"] for e in stored]
    assert stored[-1]["type"] in TERMINAL
    assert sum(e["type"] in TERMINAL for e in stored) == 1


async def test_an_odd_cursor_on_one_reader_does_not_stall_another(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str
) -> None:
    async with clients(pair) as (a, b):
        await put(a, talking_workflow(f"odd-{unique}", words=30, tps=30))
        execution_id = await execute(a, f"odd-{unique}")
        opened = asyncio.Event()
        # On B, which does not run it: first a reader with a cursor far above the end...
        odd = asyncio.create_task(
            follow(b, execution_id, cursor=1000, started=opened, timeout=STREAM_DEADLINE)
        )
        await opened.wait()
        # ...then one from the start, which must get every event, to the terminal one.
        plain = await follow(b, execution_id, timeout=STREAM_DEADLINE)
        stored = await all_events(a, execution_id)
        # The odd reader gets the terminal event alone (SPEC §5: never a bare end).
        assert [frame.json for frame in await odd] == [stored[-1]]
    covered(stored, plain)


@pytest.mark.parametrize("on", ["owner", "other"])
async def test_a_cursor_above_the_last_id_still_ends_at_the_terminal_event(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str, on: str
) -> None:
    async with clients(pair) as (a, b):
        await put(a, talking_workflow(f"above-{unique}", words=4, tps=8))
        execution_id = await execute(a, f"above-{unique}")
        frames = await follow(
            a if on == "owner" else b, execution_id, cursor=1000, timeout=STREAM_DEADLINE
        )
        snapshot = await wait_finished(a, execution_id)
        stored = await all_events(a, execution_id)
    # A cursor above the log saw ids never stored: its stream ends with the terminal
    # event, whatever its id (SPEC §5 as amended in step 15, F1).
    assert [frame.json for frame in frames] == [stored[-1]]
    assert snapshot["status"] == "completed" and snapshot["lastEventId"] < 1000


async def test_a_cancel_while_the_pause_is_being_saved_ends_the_execution(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    async with clients(pair) as (a, b):
        await put(a, approval_workflow(f"pausing-{unique}", wait_ms=300))
        execution_id = await execute(a, f"pausing-{unique}")
        reader = asyncio.create_task(follow(b, execution_id, timeout=STREAM_DEADLINE))
        # Inside the delay block: the pause is saved after it.
        await until(lambda: has_event(a, execution_id, "block:started", "wait"), "the delay")
        # Writes stall while the run saves its pause; the cancel arrives meanwhile.
        await pause_writes(valkey, 1500)
        await hold_for(0.4, "past the 300 ms delay: the run now waits to save its pause")
        # On the owner first (it stops the run mid-save), then on the other replica.
        first = await a.post(f"/api/executions/{execution_id}/cancel")
        assert first.status_code == 202, first.text
        second = await b.post(f"/api/executions/{execution_id}/cancel")
        assert second.status_code in (202, 409), second.text
        if second.status_code == 409:
            assert second.json()["error"]["status"] == "cancelled", second.text
        snapshot = await wait_finished(a, execution_id)
        frames = await reader
        stored = await all_events(a, execution_id)
    assert snapshot["status"] == "cancelled", snapshot
    covered(stored, frames)


@pytest.mark.parametrize("where", ["same", "across"])
async def test_resume_and_cancel_at_the_same_instant_each_take_effect_or_get_409(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str, where: str
) -> None:
    async with clients(pair) as (a, b):
        await put(a, approval_workflow(f"race-{unique}"))
        for attempt in range(8):
            execution_id = await execute(a, f"race-{unique}", {"n": attempt})
            await wait_status(a, execution_id, "paused")
            canceller = a if where == "same" else b
            resume, cancel = await asyncio.gather(
                a.post(f"/api/executions/{execution_id}/resume", json={"input": {"ok": True}}),
                canceller.post(f"/api/executions/{execution_id}/cancel"),
            )
            assert resume.status_code in (202, 409), resume.text
            assert cancel.status_code in (202, 409), cancel.text
            snapshot = await wait_finished(a, execution_id)
            stored = await all_events(a, execution_id)
            types = [e["type"] for e in stored]
            if resume.status_code == 202:
                assert "execution:resumed" in types, types
            if cancel.status_code == 202:
                assert snapshot["status"] == "cancelled", (types, snapshot)
            else:
                assert cancel.json()["error"]["code"] == "execution_completed", cancel.text
                assert snapshot["status"] == "completed"
            covered(stored, await follow(b, execution_id, timeout=STREAM_DEADLINE))


async def test_outputs_no_event_could_carry_are_made_carriable_without_an_id_hole(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str
) -> None:
    workflow = {
        "id": f"huge-{unique}",
        "blocks": [
            {"id": "big", "type": "transform", "config": {"value": "{{ 2 ** 64 }}"}},
            {"id": "lone", "type": "transform", "config": {"value": "{{ '\\ud800x' }}"}},
            {"id": "both", "type": "transform", "config": {"value": ["{{ -(3 ** 50) }}", 1]}},
        ],
        "edges": [],
    }
    async with clients(pair) as (a, _b):
        await put(a, workflow)
        execution_id = await execute(a, workflow["id"])
        live = await follow(a, execution_id, timeout=STREAM_DEADLINE)
        stored = await all_events(a, execution_id)
    covered(stored, live)
    assert stored[-1]["type"] == "execution:completed", stored
    output = stored[-1]["data"]["output"]
    assert output == {"big": str(2**64), "lone": "\ufffdx", "both": [str(-(3**50)), 1]}


async def test_a_store_restored_from_an_older_snapshot_never_reuses_an_id(
    pair: tuple[FlowcastServer, FlowcastServer],
    valkey: FaultyValkey,
    unique: str,
    tmp_path: Path,
) -> None:
    async with clients(pair) as (a, b):
        await put(a, talking_workflow(f"older-{unique}", words=60, tps=30))
        execution_id = await execute(a, f"older-{unique}")
        live = asyncio.create_task(follow(a, execution_id, timeout=STREAM_DEADLINE))
        await wait_last_id(a, execution_id, 10)
        snapshot = await take_snapshot(valkey, tmp_path / "older.rdb")
        await wait_last_id(a, execution_id, 25)
        await crash_and_restore(valkey, snapshot)
        finished = await wait_finished(a, execution_id)
        seen = check_view(await live)
        stored = await all_events(a, execution_id)
        replayed = await follow(b, execution_id, timeout=STREAM_DEADLINE)
    assert finished["status"] == "completed", finished
    assert seen[-1]["type"] == "execution:completed"
    same_events(seen, stored)
    covered(stored, replayed)
    gaps = [frame.json for frame in replayed if frame.event == "replay:gap"]
    assert gaps and all(gap["reason"] == "dropped" for gap in gaps), gaps


async def test_a_store_that_comes_back_empty_is_recreated_by_the_owner(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    async with clients(pair) as (a, b):
        await put(a, talking_workflow(f"empty-{unique}", words=60, tps=30))
        execution_id = await execute(a, f"empty-{unique}")
        live = asyncio.create_task(follow(a, execution_id, timeout=STREAM_DEADLINE))
        elsewhere = asyncio.create_task(follow(b, execution_id, timeout=STREAM_DEADLINE))
        await wait_last_id(a, execution_id, 15)
        await crash_and_wipe(valkey)
        await put(a, talking_workflow(f"empty-{unique}", words=60, tps=30))
        finished = await wait_finished(a, execution_id)
        seen = check_view(await live)
        followed = check_view(await elsewhere)
        stored = await all_events(a, execution_id)
    assert finished["status"] == "completed", finished
    assert seen[-1]["type"] == "execution:completed"
    assert followed[-1]["type"] == "execution:completed"
    same_events(seen, stored)
    same_events(followed, stored)


async def test_a_replica_whose_clock_runs_ahead_ends_no_healthy_execution(
    pair: tuple[FlowcastServer, FlowcastServer],
    valkey: FaultyValkey,
    unique: str,
    tmp_path: Path,
) -> None:
    skewed = replica(valkey, tmp_path, "skewed")
    skewed.env["PYTHONPATH"] = str(clock_ahead(tmp_path / "clock", seconds=60))
    await skewed.start()
    try:
        async with clients(pair) as (a, _b):
            await put(a, talking_workflow(f"skew-{unique}", words=12, tps=4))
            execution_id = await execute(a, f"skew-{unique}")
            frames = await follow(a, execution_id, timeout=STREAM_DEADLINE)
            snapshot = await wait_finished(a, execution_id)
    finally:
        await skewed.stop(signal.SIGKILL)
    assert snapshot["status"] == "completed", snapshot
    assert check_view(frames)[-1]["type"] == "execution:completed"


async def test_a_cancel_racing_the_last_event_is_either_the_end_or_a_409(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    async with clients(pair) as (a, b):
        await put(a, talking_workflow(f"last-{unique}", words=3, tps=10))
        for attempt in range(4):
            execution_id = await execute(a, f"last-{unique}", attempt)
            await wait_last_id(a, execution_id, 4)
            # The terminal event is emitted while writes stall; the cancel queues too.
            await pause_writes(valkey, 600)
            client = a if attempt % 2 == 0 else b
            cancel = await client.post(f"/api/executions/{execution_id}/cancel")
            snapshot = await wait_finished(a, execution_id)
            if cancel.status_code == 202:
                assert snapshot["status"] == "cancelled", snapshot
            else:
                assert cancel.status_code == 409, cancel.text
                assert cancel.json()["error"]["code"] == f"execution_{snapshot['status']}"


async def test_a_resumed_run_stays_counted_after_the_paused_run_lets_go(
    valkey: FaultyValkey, unique: str, tmp_path: Path
) -> None:
    workflow = approval_workflow(f"count-{unique}")
    workflow["blocks"][2] = {"id": "after", "type": "delay", "config": {"ms": 1500}}
    # Its own key prefix: runs of earlier tests' killed replicas go on counting for the
    # tenant until taken over (up to ten leases), and would fill a cap of one.
    server = replica(
        valkey,
        tmp_path,
        "capped",
        FLOWCAST_MAX_EXECUTIONS_PER_TENANT="1",
        FLOWCAST_REDIS_PREFIX=f"count{unique}",
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await put(client, workflow)
            for _ in range(3):
                execution_id = await execute(client, workflow["id"])
                # Resume the moment the pause shows: the paused run may still be letting
                # go, and its cleanup must not uncount the resumed run.
                async with client.stream(
                    "GET", f"/api/executions/{execution_id}/stream"
                ) as response:
                    async for frame in events(response):
                        if frame.event == "execution:paused":
                            answer = {"input": {"ok": True}}
                            resumed = await client.post(
                                f"/api/executions/{execution_id}/resume", json=answer
                            )
                            assert resumed.status_code == 202, resumed.text
                            break
                await hold_for(0.2, "the paused run's cleanup, had it uncounted this one")
                second = await client.post(f"/api/workflows/{workflow['id']}/execute", json={})
                assert second.status_code == 429, second.text
                assert (await wait_finished(client, execution_id))["status"] == "completed"
    finally:
        await server.stop(signal.SIGKILL)


async def test_redis_holds_each_workflow_version_once_and_large_state_as_refs(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    text = "x" * 2_000_000
    workflow = approval_workflow(f"heavy-{unique}")
    workflow["blocks"].append({"id": "blob", "type": "transform", "config": {"value": text}})
    workflow["edges"].append({"from": "blob", "to": "review"})
    redis = Redis.from_url(valkey.url)
    try:
        async with clients(pair) as (a, _b):
            await put(a, workflow)
            ids = [await execute(a, workflow["id"], {"big": text}) for _ in range(3)]
            for execution_id in ids:
                await wait_status(a, execution_id, "paused")
            for execution_id in ids:
                # The input is a ref; the blob's output is held once, as its event holds
                # it (inline below the offload threshold), with no second copy for the
                # pause; and it counts against the byte budget with the events.
                key = f"fc:{{{execution_id}}}:state"
                sizes = {f.decode(): await redis.hstrlen(key, f) for f in await redis.hkeys(key)}
                assert sizes.pop("o:blob") == len(text) + 2, sizes
                assert sum(sizes.values()) < 16 * 1024, sizes
                held = int(await redis.hget(f"fc:{{{execution_id}}}:meta", "ckptBytes") or 0)
                assert len(text) < held < len(text) + 1024, held
            versions = [key async for key in redis.scan_iter("fc:workflow-version:*")]
            sizes = [await redis.strlen(key) for key in versions]
            assert sum(size > 1_000_000 for size in sizes) == 1, sizes
            for execution_id in ids:
                answer = {"input": {"ok": True}}
                response = await a.post(f"/api/executions/{execution_id}/resume", json=answer)
                assert response.status_code == 202, response.text
                assert (await wait_finished(a, execution_id))["status"] == "completed"
    finally:
        await redis.aclose()


async def wait_finished(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    """The snapshot once terminal (a 404 while a store that lost it is recreated)."""

    async def ended() -> dict[str, Any] | None:
        response = await client.get(f"/api/executions/{execution_id}")
        snapshot: dict[str, Any] = response.json()
        ok = response.status_code == 200 and snapshot["status"] in TERMINAL_STATUSES
        return snapshot if ok else None

    found: dict[str, Any] = await until(ended, "the execution ended", STREAM_DEADLINE)
    return found


async def wait_last_id(client: httpx.AsyncClient, execution_id: str, at_least: int) -> None:
    async def reached() -> bool:
        response = await client.get(f"/api/executions/{execution_id}")
        return bool(response.json().get("lastEventId", 0) >= at_least)

    await until(reached, f"id {at_least} stored", STREAM_DEADLINE, every=0.01)


def clock_ahead(directory: Path, *, seconds: float) -> Path:
    """A ``sitecustomize`` that moves this process's clock ahead: a skewed host."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        "import time\n"
        f"_SKEW = {seconds!r}\n"
        "_time, _time_ns = time.time, time.time_ns\n"
        "time.time = lambda: _time() + _SKEW\n"
        "time.time_ns = lambda: _time_ns() + int(_SKEW * 1e9)\n"
    )
    return directory


async def test_a_resume_accepted_just_before_redis_dies_still_takes_effect(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    async with clients(pair) as (a, b):
        await put(a, approval_workflow(f"dying-{unique}"))
        execution_id = await execute(a, f"dying-{unique}")
        await wait_status(a, execution_id, "paused")
        resumed = await b.post(
            f"/api/executions/{execution_id}/resume", json={"input": {"ok": True}}
        )
        # Redis dies right after the claim: the run B launched must still load its state
        # and finish once Redis is back (from its AOF).
        await crash_and_restart(valkey, down_seconds=0.5)
        snapshot = await wait_finished(a, execution_id)
        stored = await all_events(a, execution_id)
    assert resumed.status_code == 202, resumed.text
    assert snapshot["status"] == "completed", snapshot
    assert [e["type"] for e in stored].count("execution:resumed") == 1


async def test_a_sigterm_while_the_pause_is_being_saved_still_ends_the_execution(
    valkey: FaultyValkey, unique: str, tmp_path: Path
) -> None:
    owner, other = replica(valkey, tmp_path, "owner"), replica(valkey, tmp_path, "other")
    await asyncio.gather(owner.start(), other.start())
    try:
        async with (
            httpx.AsyncClient(base_url=owner.url, timeout=30) as a,
            httpx.AsyncClient(base_url=other.url, timeout=30) as b,
        ):
            await put(a, approval_workflow(f"term-{unique}", wait_ms=300))
            execution_id = await execute(a, f"term-{unique}")
            reader = asyncio.create_task(follow(b, execution_id, timeout=STREAM_DEADLINE))
            # Inside the delay block: the pause is saved after it.
            await until(lambda: has_event(a, execution_id, "block:started", "wait"), "delay")
            await pause_writes(valkey, 1500)
            await hold_for(0.4, "past the 300 ms delay: the run now waits to save its pause")
            await owner.stop(signal.SIGTERM)
            # Either the save finished within the grace (a pause, which any replica can
            # resume) or the shutdown ended the run; never a run left "running".
            settled = await wait_settled(b, execution_id)
            if settled["status"] == "paused":
                answer = {"input": {"ok": True}}
                resumed = await b.post(f"/api/executions/{execution_id}/resume", json=answer)
                assert resumed.status_code == 202, resumed.text
            snapshot = await wait_finished(b, execution_id)
            frames = await reader
            stored = await all_events(b, execution_id)
    finally:
        await asyncio.gather(owner.stop(signal.SIGKILL), other.stop(signal.SIGKILL))
    if settled["status"] == "paused":
        assert snapshot["status"] == "completed", snapshot
    else:
        # Ended by the shutdown, or, when the writes stalled past the lease, by another
        # replica's janitor (worker_lost): either way exactly once, and not stuck.
        assert snapshot["status"] == "failed", snapshot
        assert snapshot["error"]["code"] in ("shutdown", "worker_lost"), snapshot
    covered(stored, frames)


async def wait_settled(client: httpx.AsyncClient, execution_id: str) -> dict[str, Any]:
    """The snapshot once it is no longer running."""

    async def settled() -> dict[str, Any] | None:
        snapshot: dict[str, Any] = (await client.get(f"/api/executions/{execution_id}")).json()
        return snapshot if snapshot["status"] != "running" else None

    found: dict[str, Any] = await until(settled, "the run no longer running", STREAM_DEADLINE)
    return found


async def test_a_large_outcome_is_not_copied_into_the_metadata(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    size = 2 * 1024 * 1024
    workflow = {
        "id": f"outcome-{unique}",
        "blocks": [{"id": "big", "type": "payload", "config": {"bytes": size}}],
        "edges": [],
    }
    redis = Redis.from_url(valkey.url)
    try:
        async with clients(pair) as (a, b):
            await put(a, workflow)
            execution_id = await execute(a, workflow["id"])
            snapshot = await wait_finished(a, execution_id)
            meta = await redis.memory_usage(f"fc:{{{execution_id}}}:meta") or 0
            listed = (await b.get(f"/api/executions?workflowId={workflow['id']}")).json()
    finally:
        await redis.aclose()
    assert snapshot["status"] == "completed"
    output = snapshot["output"]["big"]
    assert isinstance(output, str) and len(output) >= size - 2, len(output)
    assert meta < 32 * 1024, meta
    assert listed["executions"][0]["output"] == snapshot["output"]


async def test_a_run_that_ended_before_a_rollback_is_not_ended_twice(
    pair: tuple[FlowcastServer, FlowcastServer],
    valkey: FaultyValkey,
    unique: str,
    tmp_path: Path,
) -> None:
    async with clients(pair) as (a, b):
        await put(a, talking_workflow(f"ended-{unique}", words=20, tps=40))
        execution_id = await execute(a, f"ended-{unique}")
        live = asyncio.create_task(follow(a, execution_id, timeout=STREAM_DEADLINE))
        await wait_last_id(a, execution_id, 6)
        snapshot = await take_snapshot(valkey, tmp_path / "before-the-end.rdb")
        seen = check_view(await live)
        ended = await wait_finished(a, execution_id)
        # The store forgets the end: the execution is "running" again, its lease long
        # expired. Its owner must restore its last event before any janitor ends it.
        await crash_and_restore(valkey, snapshot)
        finished = await wait_finished(b, execution_id)
        stored = await all_events(b, execution_id)
        replayed = await follow(b, execution_id, timeout=STREAM_DEADLINE)
    assert ended["status"] == finished["status"] == "completed", finished
    assert stored[-1] == seen[-1], (stored[-1], seen[-1])
    same_events(seen, stored)
    covered(stored, replayed)


async def test_a_second_resume_after_a_rollback_never_renames_seen_events(
    pair: tuple[FlowcastServer, FlowcastServer],
    valkey: FaultyValkey,
    unique: str,
    tmp_path: Path,
) -> None:
    # The store forgets a resume (and the run it started) and comes back "paused": a
    # second answer must not give the ids a client already saw to other events.
    """Found by the step 11 fault review."""
    async with clients(pair) as (a, b):
        await put(a, approval_workflow(f"rollback-{unique}"))
        execution_id = await execute(a, f"rollback-{unique}")
        await wait_status(a, execution_id, "paused")
        snapshot = await take_snapshot(valkey, tmp_path / "paused.rdb")
        opened = asyncio.Event()
        live = asyncio.create_task(follow(a, execution_id, started=opened, timeout=STREAM_DEADLINE))
        await opened.wait()
        first = await a.post(f"/api/executions/{execution_id}/resume", json={"input": {"ok": True}})
        assert first.status_code == 202, first.text
        await wait_status(a, execution_id, "completed")
        await crash_and_restore(valkey, snapshot)

        tries: list[httpx.Response] = []

        async def answered() -> bool:
            with contextlib.suppress(httpx.TransportError):
                tries.append(
                    await b.post(
                        f"/api/executions/{execution_id}/resume", json={"input": {"ok": False}}
                    )
                )
                return tries[-1].status_code != 503
            return False

        # Up to 4 s of 503s (the store's settle); the last answer is the one checked.
        await within(answered, 4)
        assert tries
        second = tries[-1]
        finished = await wait_finished(b, execution_id)
        seen = check_view(await live)
        stored = await all_events(b, execution_id)
    assert seen[-1]["data"]["output"] == {"after": {"ok": True}}, seen[-1]
    same_events(seen, stored)
    assert finished["output"] == seen[-1]["data"]["output"], (second.status_code, finished)


async def test_a_pause_with_a_deadline_is_not_left_paused_after_the_store_came_back_empty(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    """Found by the step 11 fault review."""
    workflow = approval_workflow(f"wiped-{unique}")
    workflow["blocks"][1]["config"]["timeoutSeconds"] = 2
    async with clients(pair) as (a, b):
        await put(a, workflow)
        execution_id = await execute(a, f"wiped-{unique}")
        await wait_status(a, execution_id, "paused")
        await crash_and_wipe(valkey)
        await put(a, workflow)
        response = await ended_or_after(b, execution_id, seconds=10)
    # Either the execution is gone with the store, or it ended by its deadline: a pause
    # whose deadline nobody watches (and whose run state is gone) waits forever.
    assert response.status_code == 404 or response.json()["status"] != "paused", response.json()


ENDED = ("completed", "failed", "cancelled")


async def ended_or_after(
    client: httpx.AsyncClient, execution_id: str, *, seconds: float
) -> httpx.Response:
    """The execution's snapshot once it is terminal (it stays so), or as it is after
    ``seconds`` (the deadline passed long ago by then; a lease and a sweep too)."""

    async def ended() -> httpx.Response | None:
        response = await client.get(f"/api/executions/{execution_id}")
        done = response.status_code == 200 and response.json()["status"] in ENDED
        return response if done else None

    found: httpx.Response | None = await within(ended, seconds, every=0.05)
    return found or await client.get(f"/api/executions/{execution_id}")


class ReplyDropper:
    """A TCP proxy to Valkey that, once armed, forwards one EVALSHA containing ``word``
    and then closes the client's connection without its reply (a lost reply)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.word: bytes | None = None
        self.fired = 0

    async def _pipe(self, src: Any, dst: Any, inspect: bool, conn: dict[str, Any]) -> None:
        try:
            while data := await src.read(65536):
                if inspect and self.word and b"EVALSHA" in data.upper() and self.word in data:
                    self.word = None
                    self.fired += 1
                    dst.write(data)
                    await dst.drain()
                    conn["drop"] = True
                    await hold_for(0.2, "Valkey runs it; its reply goes nowhere")
                    conn["client"].close()
                    conn["server"].close()
                    return
                if not inspect and conn.get("drop"):
                    return
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        async def handle(reader: Any, writer: Any) -> None:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.port)
            conn = {"client": writer, "server": server_writer}
            await asyncio.gather(
                self._pipe(reader, server_writer, True, conn),
                self._pipe(server_reader, writer, False, conn),
            )

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()


@pytest.mark.parametrize("operation", ["resume", "cancel"])
async def test_a_claim_whose_reply_was_lost_still_takes_effect(
    valkey: FaultyValkey, tmp_path: Path, unique: str, operation: str
) -> None:
    # Valkey ran the claim, the connection dropped before its reply, redis-py sent the
    # script again on a fresh connection: the answer must be what happened, and the
    # execution must not stay "running" with nobody to run or end it.
    """Found by the step 11 fault review."""
    dropper = ReplyDropper(valkey.port)
    async with dropper.serving() as port:
        proxied = replica(valkey, tmp_path, "proxied")
        proxied.env["FLOWCAST_REDIS_URL"] = f"redis://127.0.0.1:{port}"
        direct = replica(valkey, tmp_path, "direct")
        await asyncio.gather(proxied.start(), direct.start())
        try:
            async with clients((proxied, direct)) as (a, b):
                await put(b, approval_workflow(f"lost-{unique}"))
                # Warm the script cache: the armed call must run the script, not NOSCRIPT.
                warm = await execute(b, f"lost-{unique}")
                await wait_status(b, warm, "paused")
                answer = {"input": {"ok": True}}
                assert (await a.post(f"/api/executions/{warm}/resume", json=answer)).is_success
                execution_id = await execute(b, f"lost-{unique}")
                await wait_status(b, execution_id, "paused")
                stream = asyncio.create_task(follow(b, execution_id, timeout=STREAM_DEADLINE))
                dropper.word = f"${len(operation)}\r\n{operation}\r\n".encode()
                body = answer if operation == "resume" else None
                response = await a.post(f"/api/executions/{execution_id}/{operation}", json=body)
                assert dropper.fired == 1
                frames = await stream  # every stream ends within about a lease
                stored = await all_events(b, execution_id)
        finally:
            await asyncio.gather(proxied.stop(), direct.stop())
    # It ends (the claim's work done, or a janitor ending what nobody runs), and the
    # answer says what happened: a 202 did it, a 409 did not.
    types = [envelope["type"] for envelope in check_view(frames)]
    assert types and types[-1] in TERMINAL, (response.text, types)
    wanted = "execution:resumed" if operation == "resume" else "execution:cancelled"
    happened = wanted in [envelope["type"] for envelope in stored]
    if response.status_code == 202:
        assert happened, (response.text, stored)
    if response.status_code == 409:
        assert not happened, (response.text, stored)
