"""Chaos on the stream: many executions, clients that drop and reconnect at random.

Every client ends with exactly the ids after its first cursor, in order, each once (or
an explicit ``replay:gap``), identical to the execution's stored log. The random source
is seeded, so a failure reproduces with the same sequence of disconnects.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import SESSION_PREFIX
from tests.support.logcheck import TERMINAL, check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, parse_frame

SEED = 20261129
EXECUTIONS = 50
ACTIVE_EXECUTIONS = 8  # bounded so the run fits a loaded 2-core machine


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


def serial_workflow(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "intro", "type": "transform", "config": {"value": "{{ input.n }}"}},
            {
                "id": "talk",
                "type": "generate",
                "config": {"text": words(60, "s"), "tokensPerSecond": 150},
            },
            {"id": "burst", "type": "generate", "config": {"text": words(200, "b")}},
        ],
        "edges": [{"from": "intro", "to": "talk"}, {"from": "talk", "to": "burst"}],
    }


def parallel_workflow(workflow_id: str) -> dict[str, Any]:
    branches = [("slow", 40, 60), ("mid", 60, 200), ("fast", 80, 500), ("flat", 120, 0)]
    blocks: list[dict[str, Any]] = [
        {"id": "outline", "type": "transform", "config": {"value": {"n": "{{ input.n }}"}}},
        {"id": "wait", "type": "delay", "config": {"ms": 150}},
    ]
    edges = [{"from": "outline", "to": "wait"}]
    for name, count, tps in branches:
        blocks.append(
            {
                "id": name,
                "type": "generate",
                "config": {"text": words(count, name), "tokensPerSecond": tps},
            }
        )
        edges += [{"from": "outline", "to": name}, {"from": name, "to": "join"}]
    blocks.append({"id": "join", "type": "transform", "config": {"value": "{{ input.n }}"}})
    edges.append({"from": "wait", "to": "join"})
    return {"id": workflow_id, "blocks": blocks, "edges": edges}


@dataclass
class View:
    """What one client received over all its connections."""

    start: int
    frames: list[Frame] = field(default_factory=list)


@dataclass
class Tally:
    connections: int = 0
    frames: int = 0
    no_content: int = 0
    query_cursors: int = 0


async def stored_log(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after = 0
    while True:
        response = await client.get(f"/api/executions/{execution_id}/events?after={after}")
        assert response.status_code == 200, response.text
        page = response.json()
        found += page["events"]
        if not page["events"]:
            return found
        after = page["nextAfter"]


async def cut_frames(response: httpx.Response, cut_at: int | None) -> AsyncIterator[Frame]:
    """Event frames of a stream; with ``cut_at``, the connection drops after that many
    bytes, maybe inside a frame, whose partial bytes are then discarded as a browser would."""
    pending = b""
    received = 0
    async for chunk in response.aiter_bytes():
        if cut_at is not None and received + len(chunk) > cut_at:
            chunk = chunk[: cut_at - received]
        received += len(chunk)
        pending += chunk
        while b"\n\n" in pending:
            raw, pending = pending.split(b"\n\n", 1)
            frame = parse_frame(raw)
            if frame.event is not None:
                yield frame
        if cut_at is not None and received >= cut_at:
            return
    assert pending.strip() == b"", f"stream ended inside a frame: {pending!r}"


async def follow(
    clients: Sequence[httpx.AsyncClient],
    url: str,
    rng: random.Random,
    start: int,
    tally: Tally,
    *,
    pause: float = 0.05,
) -> View:
    """Read a stream in random bites, reconnecting with the last id until it ends; each
    connection goes to one of ``clients`` (servers behind a load balancer)."""
    view = View(start=start)
    cursor = start
    while True:
        if view.frames and view.frames[-1].id is None:
            # Cut right after a gap frame: the same cursor gets the same gap again.
            view.frames.pop()
        bite = 0 if rng.random() < 0.1 else rng.randint(1, 40)
        # Sometimes the connection drops after a byte count instead, often mid-frame.
        cut_at = rng.randint(1, 12_000) if rng.random() < 0.3 else None
        headers = {"Accept": "text/event-stream"}
        target = url
        if rng.random() < 0.3:
            target = f"{url}?lastEventId={cursor}"
            tally.query_cursors += 1
        else:
            headers["Last-Event-ID"] = str(cursor)
        tally.connections += 1
        client = rng.choice(clients)
        async with client.stream("GET", target, headers=headers) as response:
            if response.status_code == 204:
                # Only a cursor at the terminal event may be told the stream is over.
                assert view.frames and view.frames[-1].event in TERMINAL, view.frames[-1:]
                tally.no_content += 1
                return view
            assert response.status_code == 200, response.status_code
            taken = 0
            ended = False
            async for frame in cut_frames(response, cut_at):
                assert not ended, f"a frame after the terminal event: {frame.raw!r}"
                view.frames.append(frame)
                tally.frames += 1
                if frame.id is None:
                    continue  # a gap frame: the id to resume from comes with the next event
                cursor = int(frame.id)
                taken += 1
                if frame.event in TERMINAL:
                    ended = True  # keep reading: the server must close the stream now
                elif taken >= bite:
                    break
        if ended:
            if rng.random() < 0.5:
                return view
            continue  # reconnect at the terminal id once more: that must be a 204
        if rng.random() < 0.5:
            await asyncio.sleep(rng.uniform(0, pause))  # a client's reconnect backoff


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_clients_that_disconnect_at_random_and_reconnect_see_every_event_once_in_order(
    server: FlowcastServer, unique: str
) -> None:
    rng = random.Random(SEED)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
        workflows = [
            serial_workflow(f"chaos-serial-{unique}"),
            parallel_workflow(f"chaos-par-{unique}"),
        ]
        for workflow in workflows:
            response = await client.put(f"/api/workflows/{workflow['id']}", json=workflow)
            assert response.status_code in (200, 201), response.text

        gate = asyncio.Semaphore(ACTIVE_EXECUTIONS)
        tally = Tally()
        # One child generator per execution, drawn up front: the plan does not depend on
        # how the tasks happen to interleave.
        plans = [random.Random(rng.getrandbits(64)) for _ in range(EXECUTIONS)]

        async def run(number: int, plan: random.Random) -> tuple[str, list[View]]:
            async with gate:
                workflow = plan.choice(workflows)
                response = await client.post(
                    f"/api/workflows/{workflow['id']}/execute", json={"input": {"n": number}}
                )
                assert response.status_code == 202, response.text
                started = response.json()
                clients = plan.randint(1, 3)
                starts = [0] + [plan.choice([0, 0, 1, 2, 3]) for _ in range(clients - 1)]
                seeds = [plan.getrandbits(64) for _ in range(clients)]

                async def one(start: int, seed: int) -> View:
                    client_rng = random.Random(seed)
                    if client_rng.random() < 0.5:
                        await asyncio.sleep(client_rng.uniform(0, 0.3))  # join mid-run
                    return await follow([client], started["streamUrl"], client_rng, start, tally)

                views = await asyncio.gather(
                    *(one(start, seed) for start, seed in zip(starts, seeds, strict=True))
                )
                return started["executionId"], list(views)

        loop = asyncio.get_running_loop()
        began = loop.time()
        results = await asyncio.gather(*(run(n, plan) for n, plan in enumerate(plans)))
        elapsed = loop.time() - began

        total_events = 0
        for execution_id, views in results:
            log = await stored_log(client, execution_id)
            check_log(log)
            assert {envelope["executionId"] for envelope in log} == {execution_id}
            total_events += len(log)
            for view in views:
                envelopes = check_view(view.frames, after=view.start)
                if view.start == 0:
                    check_log(envelopes)
                assert envelopes == log[view.start :], f"{execution_id}: view differs from log"
                assert all(frame.event != "replay:gap" for frame in view.frames)

    clients = sum(len(views) for _, views in results)
    print(
        f"\n{EXECUTIONS} executions, {total_events} events, {clients} clients, "
        f"{tally.connections} connections ({tally.query_cursors} with ?lastEventId, "
        f"{tally.no_content} ended by 204), {tally.frames} frames, {elapsed:.1f}s"
    )
    assert tally.no_content > 0 and tally.query_cursors > 0
    assert tally.connections > 2 * clients


RING_EVENTS = 40


@pytest.fixture(scope="module")
async def small_ring_server(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    flowcast = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("small-ring"),
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_EVENT_LIMIT": str(RING_EVENTS)},
    )
    await flowcast.start()
    yield flowcast
    await flowcast.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_clients_that_fall_behind_a_small_ring_get_explicit_gaps_and_nothing_else_missing(
    small_ring_server: FlowcastServer, unique: str
) -> None:
    rng = random.Random(SEED + 1)
    workflow = {
        "id": f"ring-{unique}",
        "blocks": [
            {
                "id": "talk",
                "type": "generate",
                "config": {"text": words(300, "r"), "tokensPerSecond": 400},
            }
        ],
        "edges": [],
    }
    tally = Tally()
    gate = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=small_ring_server.url, timeout=30) as client:
        response = await client.put(f"/api/workflows/{workflow['id']}", json=workflow)
        assert response.status_code in (200, 201), response.text

        async def run(plan: random.Random) -> tuple[str, list[View]]:
            async with gate:
                response = await client.post(f"/api/workflows/{workflow['id']}/execute", json={})
                assert response.status_code == 202, response.text
                url = response.json()["streamUrl"]
                seeds = [plan.getrandbits(64) for _ in range(plan.randint(1, 3))]
                views = await asyncio.gather(
                    # Long pauses between connections: the ring moves on meanwhile.
                    *(follow([client], url, random.Random(s), 0, tally, pause=0.4) for s in seeds)
                )
                return response.json()["executionId"], list(views)

        plans = [random.Random(rng.getrandbits(64)) for _ in range(12)]
        results = await asyncio.gather(*(run(plan) for plan in plans))

        gaps = 0
        for execution_id, views in results:
            log = await stored_log(client, execution_id)
            assert len(log) == RING_EVENTS
            last = log[-1]["id"]
            assert [envelope["id"] for envelope in log] == list(range(last - 39, last + 1))
            retained = {envelope["id"]: envelope for envelope in log}
            for view in views:
                envelopes = check_view(view.frames)
                for frame in view.frames:
                    if frame.event == "replay:gap":
                        gaps += 1
                        assert frame.json["reason"] == "evicted", frame.json
                assert envelopes[-1]["id"] == last
                assert envelopes[-1]["type"] == "execution:completed"
                for envelope in envelopes:
                    if envelope["id"] in retained:
                        assert envelope == retained[envelope["id"]]
                if not any(frame.event == "replay:gap" for frame in view.frames):
                    check_log(envelopes)
    print(f"\nsmall ring: {tally.connections} connections, {gaps} gaps")
    assert gaps > 0


@pytest.fixture(scope="module")
async def second_server(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FlowcastServer]:
    """Another process on the session's Valkey, next to the session's server."""
    flowcast = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("second"),
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": SESSION_PREFIX},
    )
    await flowcast.start()
    yield flowcast
    await flowcast.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_clients_that_reconnect_to_either_process_see_every_event_once_in_order(
    server: FlowcastServer, second_server: FlowcastServer, unique: str
) -> None:
    rng = random.Random(SEED + 2)
    tally = Tally()
    gate = asyncio.Semaphore(ACTIVE_EXECUTIONS)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as first,
        httpx.AsyncClient(base_url=second_server.url, timeout=30) as second,
    ):
        workflows = [
            serial_workflow(f"either-serial-{unique}"),
            parallel_workflow(f"either-par-{unique}"),
        ]
        for workflow in workflows:
            response = await first.put(f"/api/workflows/{workflow['id']}", json=workflow)
            assert response.status_code in (200, 201), response.text

        async def run(plan: random.Random) -> tuple[str, list[View]]:
            async with gate:
                owner = plan.choice([first, second])
                workflow = plan.choice(workflows)
                response = await owner.post(f"/api/workflows/{workflow['id']}/execute", json={})
                assert response.status_code == 202, response.text
                url = response.json()["streamUrl"]
                seeds = [plan.getrandbits(64) for _ in range(plan.randint(1, 3))]
                views = await asyncio.gather(
                    *(follow([first, second], url, random.Random(s), 0, tally) for s in seeds)
                )
                return response.json()["executionId"], list(views)

        plans = [random.Random(rng.getrandbits(64)) for _ in range(20)]
        results = await asyncio.gather(*(run(plan) for plan in plans))
        for execution_id, views in results:
            log = await stored_log(second, execution_id)
            check_log(log)
            for view in views:
                envelopes = check_view(view.frames)
                check_log(envelopes)
                assert envelopes == log, f"{execution_id}: view differs from the stored log"
    print(f"\neither process: {tally.connections} connections, {tally.no_content} ended by 204")
