"""The live list ends up as a reload shows it (SPEC §9), whatever happens around it:
a full filtered list whose row leaves, a status message Redis will not publish, Redis
failing around a list, a burst with lost messages, an execution started while the list
is read. With real processes."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import (
    approval_workflow,
    execute,
    put,
    quick_workflow,
    wait_finished,
    wait_status,
    within,
)
from tests.support.live_list import LIVE, View, live_frames, settles_on
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import events
from tests.support.sse import frames as sse_frames
from tests.support.timing import hold_for

FRAME_SECONDS = 10


# ---------------------------------------------------------------- the status messages


def delay_then_done(workflow_id: str, ms: int) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "wait", "type": "delay", "config": {"ms": ms}}],
        "edges": [],
    }


# ---------------------------------------------------------------- the live list's slot


async def _opens(client: httpx.AsyncClient, query: str = "") -> int:
    async with client.stream("GET", f"{LIVE}?{query}") as response:
        if response.status_code == 200:
            async with asyncio.timeout(FRAME_SECONDS):
                frame = await anext(events(response))
            assert frame.event == "executions", frame
        else:
            await response.aread()
        return response.status_code


@asynccontextmanager
async def held_live(client: httpx.AsyncClient) -> AsyncIterator[httpx.Response]:
    """An open live list, once the slot a closed one held is back (the server gives it
    back when it sees the client leave)."""
    deadline = time.monotonic() + FRAME_SECONDS
    while True:
        async with client.stream("GET", LIVE) as response:
            if response.status_code == 200:
                yield response
                return
            await response.aread()
            assert response.status_code == 429, response.text
            assert time.monotonic() < deadline, "the slot never came back"
        await asyncio.sleep(0.1)


async def _opens_within(client: httpx.AsyncClient, seconds: float) -> int:
    statuses: list[int] = []

    async def opens() -> bool:
        statuses.append(await _opens(client))
        return statuses[-1] == 200

    await within(opens, seconds, every=0.1)
    return statuses[-1]


# ---------------------------------------------------------------- the live list


@pytest.mark.timeout(60)
async def test_a_full_status_filtered_live_list_shows_the_next_match_when_a_row_leaves_it(
    client: httpx.AsyncClient, unique: str
) -> None:
    # Two paused executions, a live list of the paused ones with room for one: it shows
    # the newer. Once that one is cancelled the older is the paused one a reload shows,
    # and the live list must show it too (SPEC §9: the list is live, filters included),
    # not an empty list until something else happens to change.
    """Found by the step 14 review."""
    workflow_id = f"full-{unique}"
    await put(client, approval_workflow(workflow_id))
    older = await execute(client, workflow_id, {})
    await wait_status(client, older, "paused")
    newer = await execute(client, workflow_id, {})
    await wait_status(client, newer, "paused")

    query = f"workflowId={workflow_id}&status=paused&limit=1"
    view = View(limit=1)
    async with live_frames(client, query) as frames:
        view.apply(await anext(frames))
        assert view.shown() == [(newer, "paused")]
        cancelled = await client.post(f"/api/executions/{newer}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        await wait_finished(client, newer)
        listed = (await client.get(f"/api/executions?{query}")).json()["executions"]
        truth = [(row["id"], row["status"]) for row in listed]
        assert truth == [(older, "paused")]
        assert await settles_on(frames, view, truth, FRAME_SECONDS) == truth


@pytest.mark.timeout(90)
async def test_a_status_message_redis_will_not_publish_never_fails_a_write_that_took_effect(
    own_valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # The list's PUBLISH comes after start.lua's and append.lua's writes, and a script
    # that fails halfway keeps what it wrote. Here Redis refuses that one PUBLISH (an
    # ACL that predates the status channel: the notify channel only), so the start of
    # an execution fails after creating it. The caller must not get an error for an
    # execution that then runs anyway (the janitor takes the orphan over, SPEC §7): a
    # best-effort message must never decide a write's outcome.
    """Found by the step 14 review."""
    admin = Redis.from_url(own_valkey.url)
    try:
        await admin.execute_command(
            "ACL", "SETUSER", "flowcast", "on", ">pw", "~*", "&*", "+@all", "-publish",
            "(+publish ~* &fc:notify)",
        )  # fmt: skip
    finally:
        await admin.aclose()
    url = f"redis://flowcast:pw@127.0.0.1:{own_valkey.port}/0"
    server = FlowcastServer(
        data_dir=tmp_path / "server",
        env={"FLOWCAST_REDIS_URL": url, "FLOWCAST_LEASE_SECONDS": "1"},
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            workflow_id = f"acl-{unique}"
            await put(client, delay_then_done(workflow_id, 200))
            answer = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
            listed = await client.get(f"/api/executions?workflowId={workflow_id}")
            runs = listed.json()["executions"]
            # Either it was accepted, or nothing of it exists.
            assert answer.status_code == 202 or runs == [], (answer.status_code, answer.text, runs)
            assert answer.status_code == 202, answer.text
            execution_id = answer.json()["executionId"]
            async with asyncio.timeout(20):
                snapshot = await wait_finished(client, execution_id)
            assert snapshot["status"] == "completed", snapshot
    finally:
        await server.stop()


@pytest.mark.timeout(90)
async def test_a_live_list_gives_its_stream_slot_back_however_redis_fails_around_it(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    # One stream per tenant: every way a live list ends (refused at open because Redis
    # is down, left by its client while Redis is down, ended by SIGTERM while Redis is
    # down) must give the slot back, and a list open through an outage must not be cut.
    """Found by the step 14 review."""
    key = "slot-key-" + "z" * 20
    server = FlowcastServer(
        data_dir=tmp_path / "server",
        env={
            "FLOWCAST_REDIS_URL": own_valkey.url,
            "FLOWCAST_API_KEYS": key,
            "FLOWCAST_MAX_STREAMS_PER_TENANT": "1",
            "FLOWCAST_SSE_PING_SECONDS": "0.5",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    auth = {"Authorization": f"Bearer {key}"}
    try:
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=20) as client:
            own_valkey.kill()
            for _ in range(3):
                assert await _opens(client) == 503
            await own_valkey.start()
            assert await _opens_within(client, 10) == 200

            async with held_live(client) as response:
                every = sse_frames(response)
                assert (await anext(every)).event == "executions"
                own_valkey.kill()
                # Open through the outage: heartbeats, no end.
                pings = 0
                async with asyncio.timeout(FRAME_SECONDS):
                    while pings < 3:
                        pings += "ping" in (await anext(every)).comments
            await own_valkey.start()
            assert await _opens_within(client, 15) == 200

            async with held_live(client) as response:
                own_valkey.kill()
                stopping = asyncio.create_task(server.stop(signal.SIGTERM))
                async with asyncio.timeout(FRAME_SECONDS):
                    await response.aread()  # ends, whatever Redis does
                assert await stopping in (0, -signal.SIGTERM)
    finally:
        await server.stop(signal.SIGKILL)


@pytest.mark.timeout(120)
async def test_a_live_list_ends_up_as_a_reload_shows_it_after_a_burst_with_lost_messages(
    own_valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # 120 executions started at once while the server's pub/sub connection is killed
    # three times (the messages sent meanwhile are lost): once all are finished the
    # live list, applied frame by frame as a client does, shows what a reload shows.
    """Found by the step 14 review."""
    server = FlowcastServer(data_dir=tmp_path, env={"FLOWCAST_REDIS_URL": own_valkey.url})
    await server.start()
    admin = Redis.from_url(own_valkey.url)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            workflow_id = f"burst-{unique}"
            await put(client, quick_workflow(workflow_id))
            query = f"workflowId={workflow_id}&limit=200"
            view = View(limit=200)
            async with live_frames(client, query) as frames:
                view.apply(await anext(frames))

                async def start_all() -> list[str]:
                    return await asyncio.gather(
                        *(execute(client, workflow_id, {}) for _ in range(120))
                    )

                starting = asyncio.create_task(start_all())
                for _ in range(3):
                    await hold_for(0.2, "the starts go on between two pub/sub kills")
                    await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                started = await starting
                for execution_id in started:
                    await wait_finished(client, execution_id)
                listed = (await client.get(f"/api/executions?{query}")).json()["executions"]
                truth = [(row["id"], row["status"]) for row in listed]
                assert len(truth) == 120 and {status for _, status in truth} == {"completed"}
                assert await settles_on(frames, view, truth, FRAME_SECONDS) == truth
    finally:
        await admin.aclose()
        await server.stop()


@pytest.mark.timeout(120)
async def test_an_execution_started_while_the_list_is_read_is_never_dropped_from_it(
    own_valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # create() writes the tenant's index and start.lua at once (two keys, two slots on
    # a cluster), so the index can name an execution whose metadata is not there yet.
    # A list read at that moment (GET /api/executions; every live list after a pub/sub
    # reconnect) took it for expired and removed it from the index: the execution ran
    # and finished, and no list ever showed it again.
    """Found by the step 14 review."""
    server = FlowcastServer(data_dir=tmp_path, env={"FLOWCAST_REDIS_URL": own_valkey.url})
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            workflow_id = f"race-{unique}"
            await put(client, quick_workflow(workflow_id))
            query = f"workflowId={workflow_id}&limit=200"
            done = asyncio.Event()

            async def read_lists() -> None:
                while not done.is_set():
                    assert (await client.get(f"/api/executions?{query}")).status_code == 200

            readers = [asyncio.create_task(read_lists()) for _ in range(3)]
            try:
                started = await asyncio.gather(
                    *(execute(client, workflow_id, {}) for _ in range(120))
                )
            finally:
                done.set()
                await asyncio.gather(*readers)
            for execution_id in started:
                await wait_finished(client, execution_id)
            listed = (await client.get(f"/api/executions?{query}")).json()["executions"]
    finally:
        await server.stop()
    assert set(started) - {row["id"] for row in listed} == set()
