"""No tenant's data holds the event loop (SPEC §8): a large value is parsed, checked,
encoded and compacted in slices, so another tenant's requests and the replica's lease
renewals go on while it is handled.

With real processes: a Flowcast server on the session's Valkey, tenant A's large
inputs sent as raw bytes, tenant B's plain GETs probed throughout. "As fast as before"
is measured against a probe in the same test: the same GET on the same server without
the load, right before it. The server's own loop watch (app/loopwatch.py, every 2 ms
here) says how long its loop went without serving anyone, quiet and under the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.api import all_events, delay_workflow, put, start_execution, wait_finished
from tests.support.loopwatch import loop_watch, worst
from tests.support.servers import (
    ALPHA,
    BETA,
    FlowcastServer,
    ValkeyServer,
    authed,
    flowcast_on,
)
from tests.support.timing import assert_within, latencies, probing

PROBE = "/api/workflows"
# Six 10 MB echoes at once share the loop with B's GETs: their slices take turns, one
# slice (~2 ms) per turn of the loop, so each step of a GET waits for one slice, never
# for a whole value nor for a slice of each. Before the slices, B's worst GET was 2.4 s
# (one echo alone held the loop 0.4 s of CPU at once, six 21-30 s in the review); with
# a slice of each value per turn, 0.3-1.3 s; now 0.13-0.45 s over a 5-20 ms probe (2
# CPUs shared with other work, load average 3-6).
STALL_RATIO, STALL_FLOOR = 10.0, 1.5
# The loop's worst hold of its own CPU (app/loopwatch.py, ``held``) beside the six
# echoes, against the same figure while B's probe ran alone: SPEC §8's "about 50 ms".
# Measured: 15-20 ms of CPU at most (rounds of 100-180 ms before the lane of
# lib/slices.py, the sliced depth check and the early-aged parsed lists).
# The floor leaves room for a busy CI machine (75 ms once, in a bucket): the code
# before the lane held 130-200 ms, still above it.
HOLD_RATIO, HOLD_FLOOR = 2.0, 0.09
HTTP_STALL_FLOOR = 2.5
# A lease this short is lost by a replica whose loop is held a few seconds: the
# review's six echoes held it 21-30 s and B's runs were taken over (worker_lost).
LEASE_SECONDS = "2"


def zeros_body(count: int) -> bytes:
    """An execute body whose input is ``count`` zeros (about 2 bytes each)."""
    return b'{"input":[' + b",".join([b"0"] * count) + b"]}"


def echo_workflow(workflow_id: str) -> dict[str, object]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "t", "type": "transform", "config": {"value": "{{ input }}"}}],
        "edges": [],
    }


async def echo(alpha: httpx.AsyncClient, body: bytes) -> str:
    answer = await alpha.post(
        "/api/workflows/echo/execute",
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert answer.status_code == 202, answer.text
    execution_id: str = answer.json()["executionId"]
    return execution_id


@pytest.mark.timeout(240)
async def test_six_large_echoes_neither_stall_another_tenant_nor_lose_its_leases(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (step 16's review, row 1): one 9.5 MiB input of 5 million zeros
    echoed by a one-block transform held the event loop ~10 s (parsing it, checking
    its depth, walking it for offload, sizing the echo, all at once); six at once,
    21-30 s, and the replica lost its leases: another tenant's runs on it were taken
    over while it was alive. Now B's worst GET stays within a small ratio of its
    probe, none of B's runs is recovered, and A's runs end with the clear bound error
    (the echo renders past FLOWCAST_TEMPLATE_MAX_BYTES)."""
    server = await flowcast_on(
        valkey,
        tmp_path / "loop",
        api_keys=f"{ALPHA},{BETA}",
        lease_seconds=LEASE_SECONDS,
        loop_watch_ms="2",
    )
    body = zeros_body(5_000_000)
    try:
        async with authed(server, ALPHA) as alpha, authed(server, BETA) as beta:
            await put(alpha, echo_workflow("echo"))
            await put(beta, delay_workflow("wait", ms=4_000))
            started = await loop_watch(beta)
            quiet = await latencies(beta, PROBE, 40)
            before = await loop_watch(beta)
            async with probing(beta, PROBE) as loaded:
                waiting = [
                    (await start_execution(beta, "wait", {}))["executionId"] for _ in range(3)
                ]
                echoes = await asyncio.gather(*(echo(alpha, body) for _ in range(6)))
                ended = [await wait_finished(alpha, run, timeout=120) for run in echoes]
                b_ended = [await wait_finished(beta, run, timeout=60) for run in waiting]
            after = await loop_watch(beta)
            for snapshot in ended:
                assert snapshot["status"] == "failed", snapshot
                assert "renders to more than" in snapshot["error"]["message"], snapshot
            for run, snapshot in zip(waiting, b_ended, strict=True):
                assert snapshot["status"] == "completed", snapshot
                types = [event["type"] for event in await all_events(beta, run)]
                assert "execution:recovered" not in types, (run, types)
            assert_within(
                max(loaded),
                probe=max(quiet),
                ratio=STALL_RATIO,
                floor=STALL_FLOOR,
                what=f"another tenant's worst GET of {len(loaded)} beside six 10 MB echoes",
            )
            quiet_hold = worst(started, before, "held")
            assert_within(
                worst(before, after, "held"),
                probe=quiet_hold,
                ratio=HOLD_RATIO,
                floor=HOLD_FLOOR,
                what="the loop's worst hold of its CPU beside six 10 MB echoes (bucket bound; "
                f"its worst lag, waiting for a CPU included: {worst(before, after, 'lag'):g} s)",
            )
    finally:
        await server.stop(signal.SIGKILL)


@contextlib.asynccontextmanager
async def serving_json(body: bytes) -> AsyncIterator[str]:
    """A loopback HTTP server that answers every request with ``body`` as JSON."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/big"
    finally:
        listener.close()


@pytest.mark.timeout(240)
async def test_a_large_json_response_neither_stalls_another_tenant_nor_loses_its_leases(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (step 16's review, row 1): an ``http`` block receiving 35 MB of JSON
    parsed it with the standard library on the event loop; two at once held it 35 s.
    Now the response is parsed in slices: B's worst GET stays within a small ratio of
    its probe, none of B's runs is recovered, and A's run completes with the parsed
    body (its 35 MB kept in the value store).

    One such run, not the review's two: each costs the replica ~15 s of CPU (parsing,
    compacting and encoding its 700,000 items in slices, lib/slices.py), and one 35 MB
    body parsed whole would still hold the loop far past the floor and the 2 s lease
    (the review's two held it 35 s)."""
    items = [{"id": index, "name": f"item {index}", "tags": ["a", "b"]} for index in range(700_000)]
    body = orjson.dumps({"items": items})
    server = await flowcast_on(
        valkey,
        tmp_path / "http",
        api_keys=f"{ALPHA},{BETA}",
        lease_seconds=LEASE_SECONDS,
        http_allow_private="true",
        loop_watch_ms="2",
    )
    try:
        async with serving_json(body) as url, authed(server, ALPHA) as alpha:
            async with authed(server, BETA) as beta:
                call = {"id": "call", "type": "http", "config": {"url": url, "timeoutMs": 60_000}}
                await put(alpha, {"id": "fetch", "blocks": [call], "edges": []})
                await put(beta, delay_workflow("wait", ms=4_000))
                started = await loop_watch(beta)
                quiet = await latencies(beta, PROBE, 40)
                before = await loop_watch(beta)
                async with probing(beta, PROBE) as loaded:
                    waiting = [
                        (await start_execution(beta, "wait", {}))["executionId"] for _ in range(3)
                    ]
                    fetches = [(await start_execution(alpha, "fetch", {}))["executionId"]]
                    ended = [await wait_finished(alpha, run, timeout=120) for run in fetches]
                    b_ended = [await wait_finished(beta, run, timeout=60) for run in waiting]
                after = await loop_watch(beta)
        for snapshot in ended:
            assert snapshot["status"] == "completed", snapshot
        for run, snapshot in zip(waiting, b_ended, strict=True):
            assert snapshot["status"] == "completed", snapshot
            types = [event["type"] for event in await all_events_of(server, run)]
            assert "execution:recovered" not in types, (run, types)
        assert_within(
            max(loaded),
            probe=max(quiet),
            ratio=STALL_RATIO,
            floor=HTTP_STALL_FLOOR,
            what=f"another tenant's worst GET of {len(loaded)} beside a 35 MB response",
            # Measured 1.6 s with two on 2 CPUs at a load of 11, 8.5 s before the slices.
        )
        # Its 1.4 million parsed containers were walked at once by each full collection
        # of the garbage collector, 0.2-0.6 s with the loop held; they are kept out of
        # them as they are parsed (lib/letgo.py keep_out).
        assert_within(
            worst(before, after, "held"),
            probe=worst(started, before, "held"),
            ratio=HOLD_RATIO,
            floor=HOLD_FLOOR,
            what="the loop's worst hold of its CPU beside a 35 MB response (bucket bound; "
            f"its worst lag, waiting for a CPU included: {worst(before, after, 'lag'):g} s)",
        )
    finally:
        await server.stop(signal.SIGKILL)


async def all_events_of(server: FlowcastServer, execution_id: str) -> list[dict[str, Any]]:
    async with authed(server, BETA) as beta:
        return await all_events(beta, execution_id)
