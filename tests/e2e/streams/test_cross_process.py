"""Two Flowcast processes on one Valkey: a stream attached to the process that does not
run the execution gets each event pushed as it is written (``XREAD BLOCK``), heartbeats
while idle, and a server-side connection cap that loses nothing on reconnect."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import put, start_execution
from tests.support.logcheck import TERMINAL, check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, collect, frames
from tests.support.timing import assert_within

EVENTS_PER_SECOND = 20


async def start_pair(
    valkey: ValkeyServer, root: Path, env: dict[str, str]
) -> tuple[FlowcastServer, FlowcastServer]:
    shared = {"FLOWCAST_REDIS_URL": valkey.url, **env}
    pair = (
        FlowcastServer(data_dir=root / "a", env=shared),
        FlowcastServer(data_dir=root / "b", env=shared),
    )
    await asyncio.gather(*(server.start() for server in pair))
    return pair


@pytest.fixture(scope="module")
async def pair(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    """Servers A and B with quick heartbeats and the default connection cap."""
    servers = await start_pair(
        valkey, tmp_path_factory.mktemp("pair"), {"FLOWCAST_SSE_PING_SECONDS": "0.5"}
    )
    yield servers
    await asyncio.gather(*(server.stop() for server in servers))


@pytest.fixture(scope="module")
async def capped_pair(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    """Servers A and B that close every SSE connection after one second."""
    servers = await start_pair(
        valkey,
        tmp_path_factory.mktemp("capped"),
        {"FLOWCAST_SSE_MAX_SECONDS": "1", "FLOWCAST_SSE_PING_SECONDS": "0.5"},
    )
    yield servers
    await asyncio.gather(*(server.stop() for server in servers))


def paced_workflow(workflow_id: str, words: int) -> dict[str, Any]:
    text = " ".join(f"w{i}" for i in range(words))
    return {
        "id": workflow_id,
        "blocks": [
            {
                "id": "talk",
                "type": "generate",
                "config": {"text": text, "tokensPerSecond": EVENTS_PER_SECOND},
            }
        ],
        "edges": [],
    }


def idle_workflow(workflow_id: str, ms: int) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "hello", "type": "transform", "config": {"value": 1}},
            {"id": "think", "type": "delay", "config": {"ms": ms}},
            {"id": "bye", "type": "transform", "config": {"value": 2}},
        ],
        "edges": [{"from": "hello", "to": "think"}, {"from": "think", "to": "bye"}],
    }


async def stored_log(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    after = 0
    while True:
        page = (await client.get(f"/api/executions/{execution_id}/events?after={after}")).json()
        found += page["events"]
        if not page["events"]:
            return found
        after = page["nextAfter"]


async def xread_calls(redis: Redis) -> int:
    """How many XREAD commands the shared Valkey has served so far."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


def emitted_at(envelope: dict[str, Any]) -> float:
    return datetime.fromisoformat(envelope["ts"].replace("Z", "+00:00")).timestamp()


async def received_at(client: httpx.AsyncClient, url: str) -> list[tuple[Frame, float]]:
    """The event frames of one stream, each with when it arrived (wall clock, as the
    server's ``ts``)."""
    received: list[tuple[Frame, float]] = []
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200
        async for frame in frames(response):
            if frame.event is not None:
                received.append((frame, time.time()))
    return received


def chunk_delays(received: list[tuple[Frame, float]]) -> list[float]:
    """How long each chunk took from its emission to the client, past the first five
    (the ones a stream may get from its replay rather than live)."""
    return [at - emitted_at(frame.json) for frame, at in received if frame.event == "block:chunk"][
        5:
    ]


def quantile(samples: list[float], share: float) -> float:
    return sorted(samples)[int(len(samples) * share)]


async def test_a_stream_on_another_process_receives_each_event_as_it_is_written(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str
) -> None:
    a, b = pair
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, paced_workflow(f"push-{unique}", words=40))
        started = await start_execution(on_a, f"push-{unique}", {})
        # B knows the execution at once: it was created in the shared buffer before 202.
        # The owner's own stream, read beside it, is the probe: the same events on the
        # same machine at the same moment, without the hop between processes.
        on_owner, on_other = await asyncio.gather(
            received_at(on_a, started["streamUrl"]),
            received_at(on_b, started["streamUrl"]),
        )
        for received in (on_owner, on_other):
            envelopes = check_view([frame for frame, _ in received])
            check_log(envelopes)
            assert envelopes[-1]["type"] == "execution:completed"
            assert envelopes == await stored_log(on_a, started["executionId"])
            assert envelopes == await stored_log(on_b, started["executionId"])

        # Chunks come 50 ms apart; the ones each stream got live show how long each one
        # took to reach it. A sleep loop would add up to its period; a blocking read
        # adds a round trip to Valkey.
        owner, other = chunk_delays(on_owner), chunk_delays(on_other)
        print(
            f"\nchunk delay over {len(other)} events: on the other process median "
            f"{statistics.median(other) * 1000:.1f} ms, max {max(other) * 1000:.1f} ms; "
            f"on the owner median {statistics.median(owner) * 1000:.1f} ms, "
            f"max {max(owner) * 1000:.1f} ms"
        )
        assert_within(
            statistics.median(other),
            probe=statistics.median(owner),
            ratio=2,
            floor=0.03,
            what="median chunk delay to the other process (not pushed?)",
        )
        assert_within(
            quantile(other, 0.75),
            probe=quantile(owner, 0.75),
            ratio=2,
            floor=0.1,
            what="p75 chunk delay to the other process",
        )


async def test_several_streams_on_another_process_all_follow_the_execution(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str
) -> None:
    a, b = pair
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        await put(on_a, paced_workflow(f"many-{unique}", words=20))
        started = await start_execution(on_a, f"many-{unique}", {})
        url = started["streamUrl"]
        views = await asyncio.gather(
            collect(on_b, url),
            collect(on_b, url, headers={"Last-Event-ID": "2"}),
            collect(on_b, f"{url}?lastEventId=5"),
            collect(on_a, url),
        )
        log = await stored_log(on_a, started["executionId"])
        check_log(log)
        for (response, view), after in zip(views, (0, 2, 5, 0), strict=True):
            assert response.status_code == 200
            assert check_view(view, after=after) == log[after:]


@pytest.mark.parametrize("side", ["owner", "other"])
async def test_idle_streams_carry_ping_comments(
    pair: tuple[FlowcastServer, FlowcastServer], redis: Redis, unique: str, side: str
) -> None:
    a, b = pair
    reader = a if side == "owner" else b
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=reader.url, timeout=20) as on_reader,
    ):
        await put(on_a, idle_workflow(f"idle-{side}-{unique}", ms=2_500))
        started = await start_execution(on_a, f"idle-{side}-{unique}", {})
        seen: list[Frame] = []
        reads: list[int] = []
        headers = {"Accept": "text/event-stream"}
        async with on_reader.stream("GET", started["streamUrl"], headers=headers) as response:
            assert response.status_code == 200
            async for frame in frames(response):
                seen.append(frame)
                if frame.event is not None and frame.json["data"].get("blockId") == "think":
                    reads.append(await xread_calls(redis))
        pings = [frame for frame in seen if frame.event is None]
        assert all(frame.raw == b": ping" and frame.comments == ["ping"] for frame in pings)
        # Pings while the delay block runs: between its start and its completion.
        kinds = [
            "ping" if frame.event is None else f"{frame.event}:{frame.json['data'].get('blockId')}"
            for frame in seen
        ]
        begin = kinds.index("block:started:think")
        end = kinds.index("block:completed:think")
        assert kinds[begin:end].count("ping") >= 3, kinds
        # Idle for 2.5 s, the stream waits in one blocking read: a sleep loop would read
        # again and again.
        assert len(reads) == 2 and reads[1] - reads[0] <= 3, reads
        check_log(check_view([frame for frame in seen if frame.event is not None]))


async def read_capped(client: httpx.AsyncClient, url: str) -> tuple[list[Frame], list[float]]:
    """Follow a stream through every server-side close; returns frames and connection ages."""
    received: list[Frame] = []
    ages: list[float] = []
    headers = {"Accept": "text/event-stream"}
    while not received or received[-1].event not in TERMINAL:
        if received:
            headers["Last-Event-ID"] = str(received[-1].id)
        opened = time.monotonic()
        async with client.stream("GET", url, headers=headers) as response:
            assert response.status_code == 200
            # frames() fails on a connection that ends inside a frame: the close is clean.
            async for frame in frames(response):
                if frame.event is not None:
                    received.append(frame)
        ages.append(time.monotonic() - opened)
    return received, ages


@pytest.mark.parametrize("side", ["owner", "other"])
async def test_connection_cap_closes_cleanly_and_the_reconnect_loses_nothing(
    capped_pair: tuple[FlowcastServer, FlowcastServer], unique: str, side: str
) -> None:
    a, b = capped_pair
    reader = a if side == "owner" else b
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=reader.url, timeout=20) as on_reader,
    ):
        await put(on_a, paced_workflow(f"capped-{side}-{unique}", words=60))
        started = await start_execution(on_a, f"capped-{side}-{unique}", {})
        received, ages = await read_capped(on_reader, started["streamUrl"])
        envelopes = check_view(received)
        check_log(envelopes)
        assert envelopes == await stored_log(on_a, started["executionId"])
        # Three seconds of events through one-second connections: closed mid-run at
        # least twice, each close near the cap rather than at once or never.
        assert len(ages) >= 3, ages
        assert all(0.8 <= age <= 3.0 for age in ages[:-1]), ages
        response = await on_reader.get(
            started["streamUrl"], headers={"Last-Event-ID": str(envelopes[-1]["id"])}
        )
        assert response.status_code == 204
