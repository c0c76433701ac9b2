"""Workers and API replicas (SPEC §14): a replica with ``FLOWCAST_WORKER_SLOTS=0`` runs
no work, not even a recovery; a worker SIGKILLed with a run gives it back within about
a lease, to a process that runs work."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from redis.asyncio import Redis

from lib.backend import Keys
from tests.support.api import (
    approval_workflow,
    delay_workflow,
    execute,
    has_stored,
    put,
    until,
    wait_finished,
    wait_status,
)
from tests.support.faults import crash_and_restart
from tests.support.queue import most_at_once, run_log
from tests.support.servers import FlowcastServer, ValkeyServer, authed, env_on

LEASE = "1"


@pytest.mark.timeout(90)
async def test_a_dead_workers_run_waits_for_a_worker_not_an_api_replica(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = env_on(valkey, lease_seconds=LEASE)
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    first = FlowcastServer(data_dir=tmp_path / "w1", env=env)
    second = FlowcastServer(data_dir=tmp_path / "w2", env=env)
    await api.start()
    await first.start()
    try:
        async with authed(api) as client:
            await put(client, delay_workflow("slow", ms=1500))
            answer = await client.post("/api/workflows/slow/execute", json={"input": {}})
            assert answer.status_code == 202, answer.text
            eid = answer.json()["executionId"]

            async def running() -> bool:
                snapshot = (await client.get(f"/api/executions/{eid}")).json()
                return bool(snapshot["status"] == "running" and snapshot["lastEventId"] >= 2)

            await until(running, "the worker runs it", 30)
            await first.stop(signal.SIGKILL)

            # Three leases past the dead owner's (on Redis's clock): the API replica's
            # janitor found the lease due several times over, and left the run alone.
            redis = Redis.from_url(valkey.url)
            try:
                meta = Keys(env["FLOWCAST_REDIS_PREFIX"]).meta(eid)
                until_ms = int(await redis.hget(meta, "leaseUntil") or 0)

                async def leases_passed() -> bool:
                    seconds, micros = await redis.time()
                    return bool(seconds * 1000 + micros // 1000 > until_ms + 3000)

                await until(leases_passed, "three leases past the dead owner's", 20)
            finally:
                await redis.aclose()
            snapshot = (await client.get(f"/api/executions/{eid}")).json()
            assert snapshot["status"] == "running"
            await second.start()
            assert (await wait_finished(client, eid, timeout=40))["status"] == "completed"
            log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
            assert "execution:recovered" in [event["type"] for event in log]
            assert "execution recovered" not in api.logs() and "recovering an execution" not in (
                api.logs()
            )
    finally:
        await second.stop()
        await first.stop(signal.SIGKILL)
        await api.stop()


@pytest.mark.timeout(90)
async def test_a_queued_execution_no_line_holds_is_queued_again_after_a_store_restart(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    """On a cluster the line and the record live on different nodes: one restored from
    an older snapshot may hold a queued record no line holds. Here the line is emptied
    by hand, then the store restarts (losing nothing): the processes notice the store
    changed and the reconciler puts the execution back in line, so it runs."""
    valkey = own_valkey
    env = env_on(valkey, lease_seconds=LEASE, max_running_per_tenant="1")
    server = FlowcastServer(data_dir=tmp_path / "one", env=env)
    await server.start()
    redis = Redis.from_url(valkey.url)
    keys = Keys(env["FLOWCAST_REDIS_PREFIX"])
    try:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=1500))
            first = await client.post("/api/workflows/slow/execute", json={"input": {}})
            second = await client.post("/api/workflows/slow/execute", json={"input": {}})
            assert second.json()["status"] == "queued", second.text
            eid = second.json()["executionId"]
            tenant = (await redis.hget(keys.meta(eid), "tenant") or b"").decode()
            assert await redis.zrem(keys.queued(tenant), eid) == 1
            await redis.zrem(keys.waiting, tenant)
            await crash_and_restart(valkey)
            assert (await wait_finished(client, first.json()["executionId"]))["status"] == (
                "completed"
            )
            assert (await wait_finished(client, eid, timeout=40))["status"] == "completed"
            assert "queued executions no line held were queued again" in server.logs()
    finally:
        await redis.aclose()
        await server.stop()


@pytest.mark.timeout(120)
async def test_no_path_runs_a_tenant_past_its_running_cap(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Starts, resumes and recoveries all go through the admission: with a cap of 2, a
    worker SIGKILLed with 2 runs, 3 starts queued and a resume asked meanwhile, the
    tenant never has more than 2 running while another worker recovers and drains."""
    env = env_on(valkey, lease_seconds=LEASE, max_running_per_tenant="2")
    first = FlowcastServer(data_dir=tmp_path / "w1", env=env)
    second = FlowcastServer(data_dir=tmp_path / "w2", env=env)
    await first.start()
    try:
        async with authed(first) as on_first, authed(second) as on_second:
            await put(on_first, delay_workflow("slow", ms=1500))
            await put(on_first, approval_workflow("ask"))
            asked = await execute(on_first, "ask")
            await wait_status(on_first, asked, "paused")
            ids = [await execute(on_first, "slow") for _ in range(5)]
            statuses = [(await on_first.get(f"/api/executions/{e}")).json()["status"] for e in ids]
            assert statuses == ["running"] * 2 + ["queued"] * 3, statuses
            await first.stop(signal.SIGKILL)
            await second.start()
            resumed = await on_second.post(f"/api/executions/{asked}/resume", json={"input": 1})
            assert resumed.status_code == 202, resumed.text

            # What ran at once, from the stored logs, not from the list's statuses: a
            # run stops counting just before its end is stored (by design), so the list
            # may show a run still "running" beside the one its slot went to.
            logs = [await run_log(on_second, eid) for eid in [*ids, asked]]
            assert most_at_once(logs) <= 2, [
                [(e["type"], e["ts"]) for e in log if e["type"] != "block:chunk"] for log in logs
            ]
    finally:
        await second.stop()
        await first.stop(signal.SIGKILL)


@pytest.mark.timeout(120)
async def test_a_worker_recovers_a_dead_workers_runs_only_into_its_free_slots(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Two workers of 2 slots, each running 2 runs; one is SIGKILLed. The other takes
    the dead one's runs over only as its own slots free (it took them over at once
    before, running 4 on 2 slots): each is recovered once and completes, and no more
    than 2 ever work on it at one instant."""
    env = {**env_on(valkey, lease_seconds=LEASE), "FLOWCAST_WORKER_SLOTS": "2"}
    first = FlowcastServer(data_dir=tmp_path / "w1", env=env)
    second = FlowcastServer(data_dir=tmp_path / "w2", env=env)
    await second.start()
    try:
        async with authed(second) as on_second:
            await put(on_second, delay_workflow("slow", ms=4000))
            lost = [await execute(on_second, "slow") for _ in range(2)]
            for eid in lost:
                await wait_status(on_second, eid, "running")
            await first.start()
            async with authed(first) as on_first:
                kept = [await execute(on_first, "slow") for _ in range(2)]
                for eid in kept:
                    await wait_status(on_first, eid, "running")
                await second.stop(signal.SIGKILL)
                own = [await run_log(on_first, eid) for eid in kept]
                recovered = [await run_log(on_first, eid) for eid in lost]
        tails = []
        for events in recovered:
            kinds = [event["type"] for event in events]
            assert kinds.count("execution:recovered") == 1, kinds
            tails.append(events[kinds.index("execution:recovered") :])
        # What worked on the first worker: its own runs, and the others once recovered.
        assert most_at_once([*own, *tails]) <= 2, [
            [(e["type"], e["ts"]) for e in log if e["type"] != "block:chunk"]
            for log in [*own, *tails]
        ]
    finally:
        await first.stop()
        await second.stop(signal.SIGKILL)


@pytest.mark.timeout(150)
async def test_a_worker_takes_queued_work_again_once_the_recovery_it_waited_for_went_elsewhere(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A worker of 1 slot, full, finds a dead worker's run due and waits for a slot
    for it (it takes nothing from the queue meanwhile); the dead worker's node comes
    back and takes its run over itself. Nothing is due any more: once its own run
    ends, the worker takes the queued execution (it stopped taking from the queue for
    good: no janitor pass came to say that nothing waited any more, so the queued one
    waited for the other worker's 40 s run to end)."""
    env = {**env_on(valkey, lease_seconds=LEASE), "FLOWCAST_WORKER_SLOTS": "1"}
    first = FlowcastServer(data_dir=tmp_path / "w1", env=env)
    second = FlowcastServer(data_dir=tmp_path / "w2", env=env)
    await second.start()
    redis = Redis.from_url(valkey.url)
    try:
        async with authed(second) as on_second:
            await put(on_second, delay_workflow("long", ms=40_000))
            await put(on_second, delay_workflow("own", ms=12_000))
            await put(on_second, delay_workflow("next", ms=500))
            lost = await execute(on_second, "long")
            await wait_status(on_second, lost, "running")
            await first.start()
            async with authed(first) as on_first:
                own = await execute(on_first, "own")
                await wait_status(on_first, own, "running")
                await second.stop(signal.SIGKILL)

                # A lease past the dead owner's (Redis's clock): the first worker, full,
                # swept the leases at least once (every half lease) and found it due.
                meta = Keys(env["FLOWCAST_REDIS_PREFIX"]).meta(lost)
                until_ms = int(await redis.hget(meta, "leaseUntil") or 0)

                async def lease_passed() -> bool:
                    seconds, micros = await redis.time()
                    return bool(seconds * 1000 + micros // 1000 > until_ms + 1500)

                await until(lease_passed, "a lease past the dead owner's", 20)
                first_snapshot = (await on_first.get(f"/api/executions/{own}")).json()
                assert first_snapshot["status"] == "running", first_snapshot
                # Its node comes back and takes its run over at once (its slot is free).
                await second.start()
                await until(
                    lambda: has_stored(on_first, lost, "execution:recovered"),
                    "the dead worker's node took its run back",
                    30,
                )
                # Both full now: the next start waits in line.
                queued = await execute(on_first, "next")
                snapshot = (await on_first.get(f"/api/executions/{own}")).json()
                assert snapshot["status"] == "running", "the first worker's own run ended too soon"

                async def status_of(eid: str) -> str:
                    return str((await on_first.get(f"/api/executions/{eid}")).json()["status"])

                async def next_ran_or_long_ended() -> str | None:
                    if await status_of(queued) in ("running", "completed"):
                        return "queued"
                    return "long" if await status_of(lost) == "completed" else None

                # Ordering, not a time: the first worker's slot frees about 12 s in,
                # the other's about 40 s in.
                first_done = await until(next_ran_or_long_ended, "the queued one ran", 90)
                assert first_done == "queued", "the queued one waited for the long run to end"
                assert (await wait_finished(on_first, queued, timeout=30))["status"] == (
                    "completed"
                )
    finally:
        await redis.aclose()
        await first.stop()
        await second.stop(signal.SIGKILL)


@pytest.mark.timeout(120)
async def test_a_cancel_of_a_dead_workers_run_ends_it_while_every_slot_is_busy(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A worker of 1 slot runs a 40 s run; another worker's run is cancelled (202) and
    that worker is SIGKILLed. Ending the cancelled run runs none of its blocks: it needs
    no free slot, and must not wait for one (a takeover only into a free slot, 60a78ad,
    left it running, its stream open, until the 40 s run ended)."""
    env = {**env_on(valkey, lease_seconds=LEASE), "FLOWCAST_WORKER_SLOTS": "1"}
    first = FlowcastServer(data_dir=tmp_path / "w1", env=env)
    second = FlowcastServer(data_dir=tmp_path / "w2", env=env)
    await second.start()
    try:
        async with authed(second) as on_second:
            await put(on_second, delay_workflow("long", ms=40_000))
            lost = await execute(on_second, "long")
            await wait_status(on_second, lost, "running")
            await first.start()
            async with authed(first) as on_first:
                busy = await execute(on_first, "long")
                await wait_status(on_first, busy, "running")
                # Stopped first (SIGSTOP), so the cancel is flagged and never written by
                # its owner, then killed: only a takeover can end it.
                os.kill(second.pid, signal.SIGSTOP)
                cancelled = await on_first.post(f"/api/executions/{lost}/cancel")
                assert cancelled.status_code == 202, cancelled.text
                await second.stop(signal.SIGKILL)

                async def status_of(eid: str) -> str:
                    return str((await on_first.get(f"/api/executions/{eid}")).json()["status"])

                async def lost_ended_or_busy_ended() -> str | None:
                    if await status_of(lost) == "cancelled":
                        return "cancelled"
                    return "busy ended" if await status_of(busy) == "completed" else None

                # Ordering, not a time: the busy run ends about 40 s in.
                first_done = await until(lost_ended_or_busy_ended, "the cancel ended it", 90)
                assert first_done == "cancelled", "the cancel waited for a free slot"
                assert (await on_first.get(f"/api/executions/{busy}")).json()["status"] == (
                    "running"
                )
    finally:
        await first.stop(signal.SIGKILL)  # its 40 s run is no part of the test
        await second.stop(signal.SIGKILL)


@pytest.mark.timeout(120)
async def test_a_start_sent_to_a_worker_whose_recovery_waits_for_a_slot_goes_in_line(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A worker of 1 slot, full, finds a dead worker's run due: it waits for the slot.
    As the worker's own run ends, a start is sent to it, before its next janitor pass
    (a sweep every half lease; the lease is 3 s here): the start took the freed slot and
    the recovery waited again, as long as starts kept coming (recoveries go first
    only over the queue's takes). It goes in line now, and the recovery runs first."""
    env = {**env_on(valkey, lease_seconds="3"), "FLOWCAST_WORKER_SLOTS": "1"}
    first = FlowcastServer(data_dir=tmp_path / "w1", env=env)
    second = FlowcastServer(data_dir=tmp_path / "w2", env=env)
    await second.start()
    redis = Redis.from_url(valkey.url)
    try:
        async with authed(second) as on_second:
            await put(on_second, delay_workflow("lost", ms=3000))
            await put(on_second, delay_workflow("own", ms=9_000))
            await put(on_second, delay_workflow("next", ms=500))
            lost = await execute(on_second, "lost")
            await wait_status(on_second, lost, "running")
            await first.start()
            async with authed(first) as on_first:
                own = await execute(on_first, "own")
                await wait_status(on_first, own, "running")
                await second.stop(signal.SIGKILL)
                meta = Keys(env["FLOWCAST_REDIS_PREFIX"]).meta(lost)
                until_ms = int(await redis.hget(meta, "leaseUntil") or 0)

                async def lease_passed() -> bool:
                    seconds, micros = await redis.time()
                    return bool(seconds * 1000 + micros // 1000 > until_ms + 2000)

                # Past the lease and more than half another: the worker, full, swept
                # and found the dead worker's run due.
                await until(lease_passed, "the dead owner's lease passed", 20)
                assert not await has_stored(on_first, lost, "execution:recovered")
                await wait_status(on_first, own, "completed", timeout=30)
                started = await on_first.post("/api/workflows/next/execute", json={"input": {}})
                assert started.status_code == 202, started.text
                recovered = await run_log(on_first, lost)
                after = await run_log(on_first, started.json()["executionId"])
        kinds = [event["type"] for event in recovered]
        tail = recovered[kinds.index("execution:recovered") :]  # what ran on the first
        assert most_at_once([tail, after]) <= 1, [
            [(e["type"], e["ts"]) for e in log if e["type"] != "block:chunk"]
            for log in (tail, after)
        ]
        assert tail[0]["ts"] < after[0]["ts"], (tail[0], after[0])
        assert started.json()["status"] == "queued", started.text
    finally:
        await redis.aclose()
        await first.stop()
        await second.stop(signal.SIGKILL)
