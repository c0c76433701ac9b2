"""Requests wait their turn in their caller's line (app/limits.py ``Turns``; step 16).

A process works on at most 64 requests at once, at most 8 of one caller (one key, one
token), the callers in turn; the storm that needed it is in
tests/e2e/streams/test_open_storm.py. What a turn must never cover: a body still on its
way, and a stream waiting for its next event. Either would let a caller hold its own
line (or, without keys, everyone's) with requests that cost the server nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from redis.asyncio import Redis

from app.auth import tenant_of_key
from app.idempotency import PENDING_SECONDS, fingerprint
from lib.backend import Keys
from tests.support.api import approval_workflow, paused_execution, put
from tests.support.servers import (
    ALPHA,
    BETA,
    ROOT,
    FlowcastServer,
    ValkeyServer,
    authed,
    env_on,
    prefix,
    serving,
)
from tests.support.timing import assert_within, hold_for, latencies, probing

PER_CALLER = 8  # Turns' default


@pytest.fixture(scope="module")
async def server(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    root: Path = tmp_path_factory.mktemp("turns")
    async with serving(valkey, root, api_keys=ALPHA) as served:
        yield served


@pytest.mark.timeout(30)
async def test_bodies_on_their_way_hold_no_turn(server: FlowcastServer) -> None:
    """Twice the per-caller turns of PUTs whose bodies never finish: the same key's GET is
    still answered at once."""
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(PER_CALLER * 2):
            _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            stack.callback(writer.close)
            writer.write(
                b"PUT /api/workflows/slow HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + f"Authorization: Bearer {ALPHA}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            await writer.drain()
        async with authed(server, ALPHA) as alpha, asyncio.timeout(5):
            assert (await alpha.get("/api/workflows")).status_code == 200


@pytest.mark.timeout(30)
async def test_streams_waiting_for_events_hold_no_turn(server: FlowcastServer) -> None:
    """Twice the per-caller turns of streams at the live end of a paused run (nothing to
    send until it is resumed): the same key's GET and resume are answered at once, and
    every stream then gets the rest of the run."""
    async with authed(server, ALPHA) as alpha:
        await put(alpha, approval_workflow("turns-held"))
        execution_id = await paused_execution(alpha, "turns-held")
        last = (await alpha.get(f"/api/executions/{execution_id}")).json()["lastEventId"]
        url = f"/api/executions/{execution_id}/stream"
        async with contextlib.AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(
                    alpha.stream("GET", url, headers={"Last-Event-ID": str(last)})
                )
                for _ in range(PER_CALLER * 2)
            ]
            assert {stream.status_code for stream in streams} == {200}
            async with asyncio.timeout(5):
                assert (await alpha.get("/api/workflows")).status_code == 200
                resumed = await alpha.post(f"/api/executions/{execution_id}/resume", json={})
            assert resumed.status_code == 202, resumed.text
            async with asyncio.timeout(15):
                texts = await asyncio.gather(*(stream.aread() for stream in streams))
            assert all(b"event: execution:completed" in text for text in texts)


STORM = 1_500  # streams of one key opened at once (from another process)


async def worst_beside_storm(
    server: FlowcastServer, beta: httpx.AsyncClient, path: str, *mode: str
) -> float:
    """Beta's worst GET while ``STORM`` streams of alpha's open, plain or as ``mode``
    says (tests/support/storm.py); the storm's process is killed once they opened."""
    async with probing(beta, "/api/workflows") as loaded:
        await storm_of(server, path, *mode)
    return max(loaded)


async def storm_of(server: FlowcastServer, path: str, *mode: str) -> None:
    """``STORM`` opens of ``path`` from a process of their own (tests/support/storm.py),
    as ``mode`` says; the process is killed once every one was answered."""
    storm = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.storm",
        str(server.port), path, ALPHA, str(STORM), *mode,
        cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert storm.stdout is not None
        async with asyncio.timeout(120):
            opened = json.loads(await storm.stdout.readline())
    finally:
        storm.kill()
        await storm.wait()
    assert opened["opened"] == STORM and not opened["failed"], opened


@pytest.mark.parametrize(
    "mode",
    [
        # Keyed by the header's bytes, each spelling (the scheme's case, the spaces
        # before the key) was a caller of its own, with its own 8 turns and its own
        # place in the gate: 0.17 s -> 2.28 s.
        "spelled",
        # A turn was taken once the announced body was read; a route that never reads
        # one (every GET) then ran without a turn.
        "bodied",
    ],
)
@pytest.mark.timeout(300)
async def test_a_storm_waits_in_its_callers_line_however_its_requests_look(
    tmp_path: Path, valkey: ValkeyServer, mode: str
) -> None:
    """One key's 1,500 stream opens wait in its line however they look (each spelling
    its ``Authorization`` its own way; each carrying a body a GET does not read):
    another tenant's worst GET meanwhile stays within a bound of its worst beside 1,500
    plain opens of that key."""
    env = env_on(valkey, api_keys=f"{ALPHA},{BETA}", max_streams_per_tenant=str(STORM * 4))
    server = FlowcastServer(data_dir=tmp_path / mode, env=env)
    await server.start()
    try:
        async with authed(server, ALPHA) as alpha, authed(server, BETA) as beta:
            await put(alpha, approval_workflow("held"))
            path = f"/api/executions/{await paused_execution(alpha, 'held')}/stream"
            plain = await worst_beside_storm(server, beta, path)
            shaped = await worst_beside_storm(server, beta, path, mode)
        print(f"beside plain opens {plain:.3f} s, beside {mode} ones {shaped:.3f} s")
        assert_within(
            shaped,
            probe=plain,
            ratio=2.5,
            floor=0.5,
            what=f"beta's worst GET beside {STORM} {mode} opens (beside plain: {plain:.2f} s)",
        )
    finally:
        await server.stop()


@pytest.mark.timeout(300)
async def test_health_checks_are_answered_beside_a_storm_without_keys(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    """1,500 stream opens without a key (each refused 401) share one line, the line of
    every request without a key: the load balancer's ``/healthz`` and ``/readyz``
    (which need none) are answered meanwhile within a bound of a keyed tenant's GET,
    so a flood from anyone cannot get a replica taken out of service."""
    env = env_on(valkey, api_keys=f"{ALPHA},{BETA}")
    server = FlowcastServer(data_dir=tmp_path / "keyless", env=env)
    await server.start()
    try:
        async with (
            authed(server, BETA) as beta,
            authed(server) as balancer,
            probing(beta, "/api/workflows") as keyed,
            probing(balancer, "/healthz") as live,
            probing(balancer, "/readyz") as ready,
        ):
            await storm_of(server, "/api/executions/any/stream", "keyless")
        worst = {"healthz": max(live), "readyz": max(ready), "keyed": max(keyed)}
        assert_within(
            max(worst["healthz"], worst["readyz"]),
            probe=worst["keyed"],
            ratio=3,
            floor=0.3,
            what=f"the worst health check beside {STORM} keyless opens ({worst})",
        )
    finally:
        await server.stop()


@pytest.mark.timeout(120)
async def test_repeats_waiting_for_a_dead_first_request_hold_no_turn(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    """A keyed cancel whose first request's process died leaves its key pending (60 s):
    a repeat waits up to 30 s for the first's outcome, costing nothing. Twice the
    per-caller turns of such repeats: the same key's GETs meanwhile stay within a bound
    of their quiet probe (the repeats held all 8 turns, and the GETs waited out the 30 s)."""
    own = prefix()
    async with (
        serving(valkey, tmp_path, api_keys=ALPHA, redis_prefix=own) as server,
        authed(server, ALPHA) as alpha,
        Redis.from_url(valkey.url) as redis,
    ):
        await put(alpha, approval_workflow("held"))
        execution_id = await paused_execution(alpha, "held")
        operation = f"cancel:{execution_id}"
        digest = hashlib.sha256(await fingerprint(execution_id, b"")).hexdigest()
        keys = [f"dead-first-{index}" for index in range(PER_CALLER * 2)]
        names = [
            Keys(own).idempotency(
                tenant_of_key(ALPHA), operation, hashlib.sha256(key.encode()).hexdigest()
            )
            for key in keys
        ]
        for name in names:  # what a process killed inside the first request leaves
            await redis.set(name, orjson.dumps({"fingerprint": digest}), ex=PENDING_SECONDS)
        quiet = await latencies(alpha, "/api/workflows", 20)
        url = f"/api/executions/{execution_id}/cancel"
        repeats = [
            asyncio.create_task(alpha.post(url, headers={"Idempotency-Key": key})) for key in keys
        ]
        try:
            async with probing(alpha, "/api/workflows") as loaded:
                await hold_for(1.5, "the repeats wait on their first requests meanwhile")
            assert not any(repeat.done() for repeat in repeats)
        finally:
            # The pending records expire: each repeat is answered 409 at once.
            await redis.delete(*names)
            answers = await asyncio.gather(*repeats, return_exceptions=True)
        codes = {a.json()["error"]["code"] for a in answers if isinstance(a, httpx.Response)}
        assert codes == {"idempotency_retry"}, answers
    assert_within(
        max(loaded),
        probe=max(quiet),
        ratio=10,
        floor=1.0,
        what=f"the key's worst GET beside {len(keys)} waiting repeats",
    )
