"""A secret's value never appears in an event, an error or a log line (SPEC §2.1),
however it is spelled: inside query syntax, percent-encoded by httpx, overlapping
another, echoed back by a provider, read again after a resume.

With real processes: Flowcast servers on the session's Valkey, the fake provider of
tests/support/llm.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.support.api import all_events, execute, put, start_execution, until, wait_finished
from tests.support.llm import FakeLLM, Reply, fresh, llm, llm_block, one_block
from tests.support.servers import (
    ALPHA,
    BETA,
    ValkeyServer,
    authed,
    prefix,
    serving,
    started_server,
)

__all__ = ["fresh", "llm"]  # the module's fake provider (tests/support/llm.py)


# --------------------------------------------------------------------------- more leaks


class _EchoKey(BaseHTTPRequestHandler):
    """A provider that refuses the key and says which key it got (as some proxies do)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        got = self.headers.get("authorization", "").removeprefix("Bearer ")
        body = json.dumps({"error": {"message": f"Incorrect API key provided: {got}"}}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


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


# --------------------------------------------------------------------------- secrets


async def test_a_tenant_secret_spelled_like_query_syntax_leaves_stream_tokens_redacted(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break: tenant A stores the secret value ``token`` (or ``=``, ``?``, ``&``; now
    ``/stream?token=``, values under 8 characters being refused) and runs
    one http block reading it. From then on the log formatter masks that value *before*
    it redacts ``?token=`` query parameters, so ``?token=<streamToken>`` in the access
    log becomes ``?***=<streamToken>``: tenant B's stream token reaches the log
    (SPEC §8: tokens never reach a log line). Found by the step 12 review."""
    server = await started_server(
        tmp_path,
        "tok",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_API_KEYS=f"{ALPHA},{BETA}",
        FLOWCAST_HTTP_ALLOW_PRIVATE="true",
        ACCESS_LOG="1",
    )
    try:
        async with authed(server, ALPHA) as alpha, authed(server, BETA) as beta:
            # Too short to be a secret since step 16 (it blanked other tenants' lines);
            # the spelling of a stream's query is long enough.
            short = await alpha.put("/api/secrets/WORD", json={"value": "token"})
            assert short.status_code == 422, short.text
            assert (
                await alpha.put("/api/secrets/WORD", json={"value": "/stream?token="})
            ).status_code == 201
            reader = one_block(
                "reader",
                {
                    "id": "call",
                    "type": "http",
                    "config": {
                        "url": "http://127.0.0.1:1/x?q={{ secrets.WORD }}",
                        "timeoutMs": 2000,
                    },
                },
            )
            await put(alpha, reader)
            await wait_finished(alpha, await execute(alpha, "reader", {}), timeout=20)

            await put(
                beta, one_block("plain", {"id": "t", "type": "transform", "config": {"value": 1}})
            )
            started = await start_execution(beta, "plain", {})
            token = started["streamToken"]
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as anonymous:
                response = await anonymous.get(f"{started['streamUrl']}?token={token}")
                assert response.status_code in (200, 204)

            async def logged() -> bool:
                # Its token's redaction, whatever the secret's mask made of the path.
                return "[redacted]" in server.logs()

            await until(logged, "the access log line of the stream request", 10, every=0.05)
            assert token not in server.logs()
    finally:
        await server.stop()


async def test_a_secret_in_an_http_url_is_masked_in_the_spelling_httpx_gives_it(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break: httpx percent-encodes a URL its own way (it keeps ``|``, ``[``, ``]``,
    ``^`` and a ``%`` that starts no escape as they are, but encodes a space), which
    matches none of the spellings the Redactor knows (urllib's ``quote`` with two safe
    sets, ``quote_plus``). The http block's error message carries the URL, so the secret
    reaches the block:failed event, the execution's error and the stored events.
    Found by the step 12 review."""
    secret = "sk live|42[x]"
    httpx_spelling = str(httpx.URL(f"http://127.0.0.1:1/hook?key={secret}")).split("key=")[1]
    async with serving(valkey, tmp_path / "url", http_allow_private="true") as server:
        async with authed(server) as client:
            assert (await client.put("/api/secrets/HOOK", json={"value": secret})).status_code in (
                200,
                201,
            )
            workflow = one_block(
                "hook",
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
            execution_id = await execute(client, "hook", {})
            snapshot = await wait_finished(client, execution_id, timeout=20)
            events = await all_events(client, execution_id)
            visible = json.dumps(snapshot) + json.dumps(events)
            assert snapshot["status"] == "failed"
            assert httpx_spelling not in visible, snapshot["error"]["message"]
            assert "live|42" not in visible


async def test_the_providers_api_key_echoed_in_an_error_is_masked(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break: the provider's ``apiKey`` is server configuration a tenant must never see,
    but ``_status_error`` (llm.py) copies the provider's error message into the block's
    error verbatim and the run's Redactor only knows tenant secrets, so a provider (or
    proxy) that quotes the key it was sent puts the server's key into block:failed,
    execution:failed and the snapshot of any tenant's execution. Found by the step 12 review."""
    provider_key = "sk-server-provider-key-0123456789"
    http = ThreadingHTTPServer(("127.0.0.1", 0), _EchoKey)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    providers = json.dumps(
        {
            "default": {
                "baseUrl": f"http://127.0.0.1:{http.server_address[1]}/v1",
                "apiKey": provider_key,
            }
        }
    )
    server = await started_server(
        tmp_path,
        "pkey",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=prefix(),
        FLOWCAST_LLM_PROVIDERS=providers,
        FLOWCAST_API_KEYS=ALPHA,
    )
    try:
        async with authed(server, ALPHA) as client:
            await put(client, one_block("ask", llm_block(retry={"attempts": 1, "backoffMs": 0})))
            execution_id = await execute(client, "ask", {})
            snapshot = await wait_finished(client, execution_id, timeout=20)
            events = await all_events(client, execution_id)
            assert snapshot["status"] == "failed"
            assert provider_key not in json.dumps(snapshot) + json.dumps(events), snapshot["error"]
    finally:
        await server.stop()
        http.shutdown()
        http.server_close()


async def test_a_secret_the_run_read_stays_masked_after_a_resume(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break (SPEC §2.1: a secret's value never appears in an event): the run's
    Redactor holds the values the run read, so a later block whose output echoes one
    (here an API that gives back what the first block stored with the secret) shows
    ``***``. But a resume (or a recovery, or a hand-off) builds a new ``_Run`` with an
    empty Redactor (executor.py, ``_Run.__init__``: ``self.redactor = Redactor()``),
    filled only by blocks that read secrets again: after an approval the same echo
    puts the secret in block:completed, the snapshot's output and the stored events.
    Found by the step 12 review (round 2)."""
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
            straight = await execute(client, "straight", {})
            snapshot = await wait_finished(client, straight, timeout=20)
            assert snapshot["status"] == "completed", snapshot
            assert secret not in json.dumps(snapshot) + json.dumps(
                await all_events(client, straight)
            )

            await put(client, _store_workflow("paused", url, pause=True))
            paused = await execute(client, "paused", {})

            async def waiting() -> bool:
                found = (await client.get(f"/api/executions/{paused}")).json()
                return found["status"] == "paused"

            await until(waiting, "the execution pauses at the approval", 20, every=0.05)
            answer = await client.post(f"/api/executions/{paused}/resume", json={"input": {}})
            assert answer.status_code == 202, answer.text
            snapshot = await wait_finished(client, paused, timeout=20)
            assert snapshot["status"] == "completed", snapshot
            visible = json.dumps(snapshot) + json.dumps(await all_events(client, paused))
            assert secret not in visible
    finally:
        await server.stop()
        http.shutdown()
        http.server_close()


# --------------------------------------------------------------------------- the Redactor


async def test_two_overlapping_secrets_are_both_masked_whole(
    valkey: ValkeyServer, llm: FakeLLM, tmp_path: Path
) -> None:
    """Was a break (minor; SPEC §2.1 a secret's value never appears): ``Redactor.text``
    replaces spellings one after the other, longest first (secrets.py, the loop at the
    end of ``text``). When two secrets overlap in a text (the end of one is the start of
    the other), replacing the first destroys the second's occurrence, so the part of the
    second outside the overlap stays in clear: the reply ``<A><rest of B>`` becomes
    ``***<rest of B>``. Masking the union of the matched ranges would not.
    Found by the step 12 review (round 2)."""
    first = "conn-" + "A" * 24 + "-shared-7f3e9"  # the longer one: replaced first
    second = "shared-7f3e9-" + "Q9x" * 6  # starts with the end of `first`
    async with serving(valkey, tmp_path / "overlap", llm_base_url=llm.url) as server:
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
            execution_id = await execute(client, "overlap", {})
            snapshot = await wait_finished(client, execution_id, timeout=20)
            assert snapshot["status"] == "completed", snapshot
            visible = json.dumps(snapshot) + json.dumps(await all_events(client, execution_id))
            assert "Q9x" * 6 not in visible, snapshot["output"]["draft"]["text"]


async def test_a_long_secret_in_an_http_url_is_masked_in_the_spelling_httpx_gives_it(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Was a break: ``_in_url`` (secrets.py) learns httpx's spelling by parsing one URL that
    holds the value twice (``"http://h/p" + value + "?q=" + value``). httpx refuses URLs
    over 65,536 characters, so for a value over ~32 K characters the parse fails and the
    httpx spelling is silently dropped, while a real URL holding the value once is
    fine: the round-1 leak (the http error message carries the URL as httpx spells it)
    is back for long secrets (a JWT bundle, a certificate, a service-account key).
    Found by the step 12 review (round 2)."""
    secret = ("sk live|42[x]^" * 600)[:8_000]  # the longest a secret may be
    httpx_spelling = str(httpx.URL(f"http://127.0.0.1:1/hook?key={secret}")).split("key=")[1]
    async with serving(valkey, tmp_path / "longurl", http_allow_private="true") as server:
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
            execution_id = await execute(client, "longhook", {})
            snapshot = await wait_finished(client, execution_id, timeout=20)
            visible = json.dumps(snapshot) + json.dumps(await all_events(client, execution_id))
            assert snapshot["status"] == "failed"
            assert httpx_spelling[:200] not in visible, snapshot["error"]["message"][:300]
