"""Step 12 review, round 2: more attempts to break llm blocks, the Redactor, the chunk
redactor, slots and secrets across resume, with real processes. Each test here
demonstrates one confirmed break."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import string
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.llm.test_break_step12 import (
    ALPHA,
    BETA,
    authed,
    execute,
    finished_within,
    llm_block,
    one_block,
    prefix,
    started_server,
    until,
)
from tests.support.api import all_events, put
from tests.support.llm import FakeLLM, Reply
from tests.support.servers import ValkeyServer


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as fake:
        yield fake


@pytest.fixture(autouse=True)
def fresh(llm: FakeLLM) -> None:
    llm.reset()


# --------------------------------------------------------------------------- cost


async def test_one_big_reply_chunk_with_large_secrets_does_not_stall_other_tenants(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Was a break (SPEC §8, no tenant can slow another): ``ChunkRedactor._prefix_tail`` tries,
    for every spelling of every secret the run read, every tail length up to
    ``min(len(spelling) - 1, len(text))``, slicing the text each time: O(spellings x
    min(L, T)^2) per chunk, on the event loop. A provider that sends a long reply in one
    piece (the non-streamed JSON answer llm.py supports, or a big delta) while the run
    read a few 64 KiB secrets (the allowed size) stalls the whole process for seconds:
    another tenant's plain GET waits that long."""
    rng = random.Random(7)
    alphabet = string.ascii_letters + ' /"'
    names = [f"BIG{i}" for i in range(10)]
    server = await started_server(
        tmp_path,
        "cost",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_API_KEYS=f"{ALPHA},{BETA}",
        FLOWCAST_LLM_BASE_URL=llm.url,
    )
    try:
        async with authed(server, ALPHA) as alpha, authed(server, BETA) as beta:
            for name in names:
                value = "".join(rng.choice(alphabet) for _ in range(8_000))  # near the cap
                answer = await alpha.put(f"/api/secrets/{name}", json={"value": value})
                assert answer.status_code == 201
            block = llm_block(retry={"attempts": 1, "backoffMs": 0})
            block["config"]["messages"] = [
                {"role": "user", "content": f"{{{{ secrets.{name} }}}}"} for name in names
            ]
            await put(alpha, one_block("big", block))

            async def latency() -> float:
                at = time.monotonic()
                assert (await beta.get("/api/workflows")).status_code == 200
                return time.monotonic() - at

            baseline = max([await latency() for _ in range(5)])
            # An ordinary long answer (~200 KB), sent in one piece.
            llm.default = Reply(pieces=["z" * 200_000])
            worst = 0.0
            stop = asyncio.Event()

            async def probe() -> None:
                nonlocal worst
                while not stop.is_set():
                    worst = max(worst, await latency())
                    await asyncio.sleep(0.01)

            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.2)  # the probe is measuring before the run starts
            execution_id = (await execute(alpha, "big"))["executionId"]
            snapshot = await finished_within(alpha, execution_id, 15)
            stop.set()
            await asyncio.wait_for(prober, 15)
            assert snapshot["status"] == "completed", snapshot
            assert worst < baseline + 0.5, (
                f"another tenant's GET took {worst:.1f} s (baseline {baseline * 1000:.0f} ms)"
            )
    finally:
        await server.stop(signal.SIGKILL)


# --------------------------------------------------------------------------- resume


class _Store(BaseHTTPRequestHandler):
    """Keeps the last body POSTed to it and gives it back on GET (like an API that
    returns a credential it was given: a webhook config, a created token)."""

    kept = b"{}"

    def do_POST(self) -> None:
        type(self).kept = self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer(b'{"ok": true}')

    def do_GET(self) -> None:
        self._answer(type(self).kept)

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _store_workflow(workflow_id: str, url: str, pause: bool) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [
        {
            "id": "store",
            "type": "http",
            "config": {"method": "POST", "url": url, "json": {"key": "{{ secrets.TOKEN }}"}},
        },
        {"id": "fetch", "type": "http", "config": {"method": "GET", "url": url}},
    ]
    edges = [{"from": "store", "to": "fetch"}]
    if pause:
        blocks.insert(
            1,
            {
                "id": "review",
                "type": "approval",
                "config": {"prompt": "go on?", "schema": {"type": "object"}},
            },
        )
        edges = [{"from": "store", "to": "review"}, {"from": "review", "to": "fetch"}]
    return {"id": workflow_id, "blocks": blocks, "edges": edges}


async def test_a_secret_the_run_read_stays_masked_after_a_resume(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (SPEC §2.1: a secret's value never appears in an event): the run's
    Redactor holds the values the run read, so a later block whose output echoes one
    (here an API that gives back what the first block stored with the secret) shows
    ``***``. But a resume (or a recovery, or a hand-off) builds a new ``_Run`` with an
    empty Redactor (executor.py, ``_Run.__init__``: ``self.redactor = Redactor()``),
    filled only by blocks that read secrets again: after an approval the same echo
    puts the secret in block:completed, the snapshot's output and the stored events."""
    secret = "sk-live-resume-0123456789abcdef"
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}/store"
    server = await started_server(
        tmp_path,
        "resume",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_HTTP_ALLOW_PRIVATE="true",
    )
    try:
        async with authed(server) as client:
            assert (await client.put("/api/secrets/TOKEN", json={"value": secret})).status_code in (
                200,
                201,
            )
            # Without a pause the echo is masked: the run read the secret.
            await put(client, _store_workflow("straight", url, pause=False))
            straight = (await execute(client, "straight"))["executionId"]
            snapshot = await finished_within(client, straight, 20)
            assert snapshot["status"] == "completed", snapshot
            assert secret not in json.dumps(snapshot) + json.dumps(
                await all_events(client, straight)
            )

            await put(client, _store_workflow("paused", url, pause=True))
            paused = (await execute(client, "paused"))["executionId"]

            async def waiting() -> bool:
                found = (await client.get(f"/api/executions/{paused}")).json()
                return found["status"] == "paused"

            await until(waiting, 20, "the execution pauses at the approval")
            answer = await client.post(f"/api/executions/{paused}/resume", json={"input": {}})
            assert answer.status_code == 202, answer.text
            snapshot = await finished_within(client, paused, 20)
            assert snapshot["status"] == "completed", snapshot
            visible = json.dumps(snapshot) + json.dumps(await all_events(client, paused))
            assert secret not in visible
    finally:
        await server.stop()
        http.shutdown()
        http.server_close()


# --------------------------------------------------------------------------- slots


async def test_a_call_waiting_for_a_slot_is_handed_off_on_sigterm_and_completes(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Probe: SIGTERM to a replica whose llm call waits in line for a slot held by
    another replica: it is handed off (not failed) and completes on the other one."""
    providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 1}})
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": prefix(),
        "FLOWCAST_LLM_PROVIDERS": providers,
        "FLOWCAST_LEASE_SECONDS": "3",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    one = await started_server(tmp_path, "h1", **env)
    two = await started_server(tmp_path, "h2", **env)
    try:
        async with authed(one) as first, authed(two) as second:
            await put(first, one_block("ask", llm_block()))
            llm.default = Reply(pieces=[f"p{i} " for i in range(20)], piece_delay=0.15)
            holder = (await execute(first, "ask", n=1))["executionId"]
            await llm.wait_in_flight(1)
            waiter = (await execute(second, "ask", n=2))["executionId"]

            async def started() -> bool:
                events = await all_events(second, waiter)
                return any(e["type"] == "block:started" for e in events)

            await until(started, 10, "the waiting call's block started")
            llm.default = Reply(text="quick answer")
            assert await two.stop(signal.SIGTERM, timeout=15) in (0, -signal.SIGTERM)
            assert (await finished_within(first, holder, 15))["status"] == "completed"
            snapshot = await finished_within(first, waiter, 15)
            assert snapshot["status"] == "completed", snapshot
            events = await all_events(first, waiter)
            types = [e["type"] for e in events]
            assert "execution:failed" not in types, types
    finally:
        await one.stop()
        await two.stop()


async def test_a_streaming_call_cut_by_sigterm_runs_again_elsewhere_and_completes(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Probe: SIGTERM to the replica whose llm call streams past the grace: the call is
    cancelled, its slot released, and the other replica runs it again to completion."""
    providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 1}})
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": prefix(),
        "FLOWCAST_LLM_PROVIDERS": providers,
        "FLOWCAST_LEASE_SECONDS": "3",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    one = await started_server(tmp_path, "s1", **env)
    two = await started_server(tmp_path, "s2", **env)
    try:
        async with authed(one) as first, authed(two) as second:
            await put(first, one_block("ask", llm_block()))
            llm.default = Reply(pieces=[f"p{i} " for i in range(100)], piece_delay=0.1)
            streaming = (await execute(first, "ask", n=1))["executionId"]
            await llm.wait_in_flight(1)
            llm.default = Reply(text="second run")
            at = time.monotonic()
            assert await one.stop(signal.SIGTERM, timeout=15) in (0, -signal.SIGTERM)
            snapshot = await finished_within(second, streaming, 15)
            assert snapshot["status"] == "completed", snapshot
            assert snapshot["output"]["draft"]["text"] == "second run"
            assert time.monotonic() - at < 8
            events = await all_events(second, streaming)
            chunks = [e for e in events if e["type"] == "block:chunk"]
            last_start = max(i for i, e in enumerate(events) if e["type"] == "block:started")
            text = "".join(e["data"]["text"] for e in events[last_start:] if e in chunks)
            assert text == "second run"
    finally:
        await one.stop()
        await two.stop()


# --------------------------------------------------------------------------- the Redactor


async def test_two_overlapping_secrets_are_both_masked_whole(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Was a break (minor; SPEC §2.1 a secret's value never appears): ``Redactor.text``
    replaces spellings one after the other, longest first (secrets.py, the loop at the
    end of ``text``). When two secrets overlap in a text (the end of one is the start of
    the other), replacing the first destroys the second's occurrence, so the part of the
    second outside the overlap stays in clear: the reply ``<A><rest of B>`` becomes
    ``***<rest of B>``. Masking the union of the matched ranges would not."""
    first = "conn-" + "A" * 24 + "-shared-7f3e9"  # the longer one: replaced first
    second = "shared-7f3e9-" + "Q9x" * 6  # starts with the end of `first`
    server = await started_server(
        tmp_path,
        "overlap",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_LLM_BASE_URL=llm.url,
    )
    try:
        async with authed(server) as client:
            for name, value in (("FIRST", first), ("SECOND", second)):
                answer = await client.put(f"/api/secrets/{name}", json={"value": value})
                assert answer.status_code in (200, 201)
            block = llm_block(retry={"attempts": 1, "backoffMs": 0})
            block["config"]["messages"] = [
                {"role": "user", "content": "use {{ secrets.FIRST }} and {{ secrets.SECOND }}"}
            ]
            await put(client, one_block("overlap", block))
            # The reply quotes a text where both appear, overlapping.
            llm.default = Reply(pieces=["saw: " + first + second.removeprefix("shared-7f3e9")])
            execution_id = (await execute(client, "overlap"))["executionId"]
            snapshot = await finished_within(client, execution_id, 20)
            assert snapshot["status"] == "completed", snapshot
            visible = json.dumps(snapshot) + json.dumps(await all_events(client, execution_id))
            assert "Q9x" * 6 not in visible, snapshot["output"]["draft"]["text"]
    finally:
        await server.stop()


async def test_a_long_secret_in_an_http_url_is_masked_in_the_spelling_httpx_gives_it(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break: ``_in_url`` (secrets.py) learns httpx's spelling by parsing one URL that
    holds the value twice (``"http://h/p" + value + "?q=" + value``). httpx refuses URLs
    over 65,536 characters, so for a value over ~32 K characters the parse fails and the
    httpx spelling is silently dropped, while a real URL holding the value once is
    fine: the round-1 leak (the http error message carries the URL as httpx spells it)
    is back for long secrets (a JWT bundle, a certificate, a service-account key)."""
    secret = ("sk live|42[x]^" * 600)[:8_000]  # the longest a secret may be
    httpx_spelling = str(httpx.URL(f"http://127.0.0.1:1/hook?key={secret}")).split("key=")[1]
    server = await started_server(
        tmp_path,
        "longurl",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_HTTP_ALLOW_PRIVATE="true",
    )
    try:
        async with authed(server) as client:
            answer = await client.put("/api/secrets/HOOK", json={"value": secret})
            assert answer.status_code in (200, 201)
            workflow = one_block(
                "longhook",
                {
                    "id": "call",
                    "type": "http",
                    "config": {
                        "url": "http://127.0.0.1:1/hook?key={{ secrets.HOOK }}",
                        "timeoutMs": 2000,
                    },
                },
            )
            await put(client, workflow)
            execution_id = (await execute(client, "longhook"))["executionId"]
            snapshot = await finished_within(client, execution_id, 20)
            visible = json.dumps(snapshot) + json.dumps(await all_events(client, execution_id))
            assert snapshot["status"] == "failed"
            assert httpx_spelling[:200] not in visible, snapshot["error"]["message"][:300]
    finally:
        await server.stop()


async def test_reading_large_secrets_does_not_stall_other_tenants(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (SPEC §8, no tenant can slow another): every attempt of a block that reads
    secrets calls ``Redactor.add`` on a fresh per-run Redactor, which computes every
    spelling of every value (``_spellings``: three ``urllib.parse.quote`` passes,
    JSON, base64, httpx) on the event loop, ~8 ms per 64 KiB value. A workflow reading
    the allowed 64 secrets of 64 KiB costs ~0.5 s of the loop per attempt, before any
    request is made; a few such executions started together freeze the process for
    seconds for every tenant (no rotation needed; past 1,000 remembered values the log
    mask is even rebuilt in full, ~10 s, on each fresh reveal)."""
    rng = random.Random(3)
    alphabet = string.ascii_letters + ' /"|'
    names = [f"K{i}" for i in range(64)]
    server = await started_server(
        tmp_path,
        "spell",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_API_KEYS=f"{ALPHA},{BETA}",
        FLOWCAST_HTTP_ALLOW_PRIVATE="true",
    )
    try:
        async with authed(server, ALPHA) as alpha, authed(server, BETA) as beta:
            for name in names:
                value = "".join(rng.choice(alphabet) for _ in range(8_000))  # near the cap
                assert (await alpha.put(f"/api/secrets/{name}", json={"value": value})).is_success
            reader = one_block(
                "reader",
                {
                    "id": "call",
                    "type": "http",
                    "config": {
                        "method": "POST",
                        "url": "http://127.0.0.1:1/x",
                        "json": {name: f"{{{{ secrets.{name} }}}}" for name in names},
                        "timeoutMs": 1000,
                    },
                },
            )
            await put(alpha, reader)

            async def latency() -> float:
                at = time.monotonic()
                assert (await beta.get("/api/workflows")).status_code == 200
                return time.monotonic() - at

            baseline = max([await latency() for _ in range(5)])
            worst = 0.0
            stop = asyncio.Event()

            async def probe() -> None:
                nonlocal worst
                while not stop.is_set():
                    worst = max(worst, await latency())
                    await asyncio.sleep(0.01)

            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.2)  # the probe is measuring before the runs start
            started = await asyncio.gather(*(execute(alpha, "reader", n=i) for i in range(6)))
            for run in started:
                await finished_within(alpha, run["executionId"], 20)
            stop.set()
            await asyncio.wait_for(prober, 15)
            assert worst < baseline + 0.5, (
                f"another tenant's GET took {worst:.1f} s (baseline {baseline * 1000:.0f} ms)"
            )
    finally:
        await server.stop(signal.SIGKILL)
