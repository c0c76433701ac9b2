"""A provider that misbehaves (a retry-after of a day or of infinity, a chunk that is
not what the API documents) gives a clear ``llm`` error instead of holding calls.

With real processes: Flowcast servers on the session's Valkey, the fake provider of
tests/support/llm.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.api import all_events, execute, put, until, wait_finished
from tests.support.llm import FakeLLM, Reply, fresh, llm, llm_block, one_block
from tests.support.servers import (
    ValkeyServer,
    authed,
    prefix,
    started_server,
)

__all__ = ["fresh", "llm"]  # the module's fake provider (tests/support/llm.py)


class _OddChunks(BaseHTTPRequestHandler):
    """A provider whose stream has a chunk with ``"choices": 5``, then a clean end."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        body = (
            b'data: {"choices": 5}\n\n'
            + b"data: " + json.dumps(finish).encode() + b"\n\n"
            + b"data: [DONE]\n\n"
        )  # fmt: skip
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


# --------------------------------------------------------------------------- 429s


async def test_a_huge_retry_after_fails_later_calls_clearly_instead_of_holding_them(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Was a break: a 429 asking for a day paused the provider for a day, and every later
    call waited in line unseen (a running execution stuck, SPEC §7). Now the pause is
    capped (``MAX_PAUSE_SECONDS``) and a call that meets a pause longer than it waits in
    line fails at once with ``llm_rate_limited``, saying so, and retries after it.
    Found by the step 12 review."""
    providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 2}})
    server = await started_server(
        tmp_path,
        "pause",
        FLOWCAST_SHUTDOWN_GRACE_SECONDS="1",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_LLM_PROVIDERS=providers,
    )
    try:
        async with authed(server) as client:
            await put(client, one_block("ask", llm_block()))
            llm.script(Reply(status=429, headers={"Retry-After": "86400"}))
            first = await wait_finished(client, await execute(client, "ask", {}), timeout=20)
            assert first["status"] == "failed" and first["error"]["code"] == "llm_rate_limited"

            second = await execute(client, "ask", {"n": 2})

            async def told() -> list[dict[str, Any]]:
                events = await all_events(client, second)
                return [e for e in events if e["type"] == "block:failed"]

            (failed,) = await until(told, "the paused call fails visibly", 20, every=0.05)
            assert failed["data"]["error"]["code"] == "llm_rate_limited"
            assert "asked every caller to wait" in failed["data"]["error"]["message"]
            assert len(llm.requests) == 1  # the paused provider was not called again
            # Its retry waits out the pause, and a cancel still ends it at once.
            assert (await client.post(f"/api/executions/{second}/cancel")).status_code == 202
            snapshot = await wait_finished(client, second, timeout=20)
            assert snapshot["status"] == "cancelled"
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "headers",
    [
        {"retry-after-ms": "inf"},
        {"x-ratelimit-reset-requests": "1e400", "x-ratelimit-remaining-requests": "0"},
    ],
)
async def test_an_infinite_rate_limit_wait_is_a_clear_llm_error(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path, headers: dict[str, str]
) -> None:
    """Was a break: ``wait_asked`` turns ``retry-after-ms: inf`` (or a reset of ``1e400``) into
    ``inf`` seconds and ``Slots.pause`` does ``int(inf * 1000)``: OverflowError, so the
    block fails as an unexpected bug (``block_error``, a traceback in the log) and is
    retried, instead of a clear ``llm_rate_limited`` failure. Found by the step 12 review."""
    providers = json.dumps({"default": {"baseUrl": llm.url, "maxConcurrency": 2}})
    server = await started_server(
        tmp_path,
        "inf",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_LLM_PROVIDERS=providers,
    )
    try:
        async with authed(server) as client:
            await put(client, one_block("ask", llm_block(retry={"attempts": 1, "backoffMs": 0})))
            llm.script(Reply(status=429, headers=headers))
            snapshot = await wait_finished(client, await execute(client, "ask", {}), timeout=20)
            assert snapshot["status"] == "failed"
            assert snapshot["error"]["code"] == "llm_rate_limited", snapshot["error"]
    finally:
        await server.stop()


async def test_a_chunk_whose_choices_is_not_a_list_is_a_clear_bad_reply(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (minor): ``_Reply.take`` iterates ``chunk.get("choices") or []`` without
    checking it is a list, so ``"choices": 5`` raises TypeError: the block fails as an
    unexpected bug (``block_error``, a traceback logged, retried as if transient) instead
    of ``llm_bad_reply`` like every other malformed chunk. Found by the step 12 review."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), _OddChunks)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server = await started_server(
        tmp_path,
        "odd",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_LLM_BASE_URL=f"http://127.0.0.1:{http.server_address[1]}/v1",
    )
    try:
        async with authed(server) as client:
            await put(client, one_block("ask", llm_block(retry={"attempts": 1, "backoffMs": 0})))
            snapshot = await wait_finished(client, await execute(client, "ask", {}), timeout=20)
            assert snapshot["status"] == "failed"
            assert snapshot["error"]["code"] == "llm_bad_reply", snapshot["error"]
    finally:
        await server.stop()
        http.shutdown()
        http.server_close()
