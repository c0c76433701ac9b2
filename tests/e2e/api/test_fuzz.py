"""The OpenAPI schema, fuzzed against a real server by schemathesis, bounded in time.

The server is seeded first (a workflow put through the API, a finished execution with an
offloaded value, a paused one, two long running ones), and the fuzzer draws path ids
from those most of the time, so it reaches the routes' logic instead of stopping at 404.
Every response must be no 5xx, carry a documented status and content type, and match
the documented schema. A second, shorter pass runs with API keys and a valid key.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import put, streaming_workflow, wait_finished, wait_status
from tests.support.servers import FlowcastServer, ValkeyServer

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
CHECKS = (
    "not_a_server_error,status_code_conformance,"
    "response_schema_conformance,content_type_conformance"
)
KEY = "fuzz-key-" + "f" * 24
# With a dictionary binding, a path parameter takes a seeded id this often and a
# generated string otherwise, so both the logic behind real ids and 404s get exercised.
SEEDED = 0.8


@dataclass(frozen=True)
class Seeds:
    """Ids of real things on the server, for the fuzzer's path parameters."""

    workflows: list[str]
    finished: str
    paused: str
    running: str
    doomed: str  # a running execution the fuzzer's cancels are aimed at
    value: str
    tokens: list[str]  # stream tokens: for the finished and the running execution

    @property
    def executions(self) -> list[str]:
        return [self.finished, self.paused, self.running, self.doomed]


@asynccontextmanager
async def fuzz_server(
    data_dir: Path, valkey: ValkeyServer, **env: str
) -> AsyncIterator[tuple[FlowcastServer, httpx.AsyncClient]]:
    server = FlowcastServer(
        data_dir=data_dir,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"fz{uuid.uuid4().hex[:8]}",
            # Streams of live executions end after a second, so they cannot hang the fuzzer.
            "FLOWCAST_SSE_MAX_SECONDS": "1",
            "FLOWCAST_SSE_PING_SECONDS": "1",
            # Small enough that the seeded payload is offloaded and has a value id.
            "FLOWCAST_LARGE_VALUE_BYTES": "1000",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
            **env,
        },
    )
    await server.start()
    headers = {"Authorization": f"Bearer {KEY}"} if "FLOWCAST_API_KEYS" in env else {}
    try:
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=20) as client:
            yield server, client
    finally:
        await server.stop()


async def execute(client: httpx.AsyncClient, workflow_id: str, body: Any) -> dict[str, Any]:
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json=body)
    assert response.status_code == 202, response.text
    started: dict[str, Any] = response.json()
    return started


def first_ref(value: Any) -> dict[str, Any] | None:
    """The first large-value ref inside a JSON value, depth first."""
    if isinstance(value, dict):
        if value.get("$ref") == "value":
            return value
        values = list(value.values())
    elif isinstance(value, list):
        values = value
    else:
        return None
    return next((ref for item in values if (ref := first_ref(item)) is not None), None)


async def seed(client: httpx.AsyncClient) -> Seeds:
    """Real workflows and executions in every state the routes tell apart."""
    quick = {
        "id": "fuzz-quick",
        "blocks": [{"id": "big", "type": "payload", "config": {"bytes": 5000}}],
    }
    await put(client, quick)
    await put(client, streaming_workflow("fuzz-long", words=500, tps=2))
    quick_run = await execute(client, "fuzz-quick", {})
    finished = quick_run["executionId"]
    snapshot = await wait_finished(client, finished)
    assert snapshot["status"] == "completed", snapshot
    ref = first_ref(snapshot["output"])
    assert ref is not None, snapshot
    paused = (await execute(client, "approve-refund", {"input": {"amount": 3}}))["executionId"]
    await wait_status(client, paused, "paused", timeout=None)
    running = await execute(client, "fuzz-long", {"input": {"name": "fuzz"}})
    doomed = (await execute(client, "fuzz-long", {"input": {"name": "doomed"}}))["executionId"]
    return Seeds(
        workflows=["fuzz-quick", "fuzz-long", "approve-refund", "stream-story"],
        finished=finished,
        paused=paused,
        running=running["executionId"],
        doomed=doomed,
        value=ref["id"],
        tokens=[quick_run["streamToken"], running["streamToken"]],
    )


def config(seeds: Seeds, *, authorization: str | None) -> str:
    """A schemathesis.toml that draws path ids from the seeds."""

    def dictionary(name: str, values: list[str]) -> str:
        return f"[dictionaries.{name}]\nvalues = {json.dumps(values)}\n"

    def bind(name: str, probability: float = SEEDED) -> str:
        return f'{{ dictionary = "{name}", probability = {probability} }}'

    lines = [
        dictionary("workflows", seeds.workflows),
        dictionary("executions", seeds.executions),
        dictionary("quick", [w for w in seeds.workflows if w != "fuzz-long"]),
        dictionary("cancellable", [seeds.doomed, seeds.finished]),
        dictionary("resumable", [seeds.paused, seeds.finished]),
        dictionary("values", [seeds.value]),
        dictionary("owner", [seeds.finished]),
        dictionary("tokens", seeds.tokens),
        "[parameters]",
        f'"path.workflow_id" = {bind("workflows")}',
        f'"query.workflowId" = {bind("workflows")}',
        f'"path.execution_id" = {bind("executions")}',
        f'"path.value_id" = {bind("values")}',
        # Half the time no token or a generated one, so the API key (if any) is used.
        f'"query.token" = {bind("tokens", 0.5)}',
        "",
        "[[operations]]",
        'include-path-regex = "/execute$"',
        # Not the long workflow: each execute of it would run for minutes.
        f'parameters = {{ "path.workflow_id" = {bind("quick")} }}',
        "",
        "[[operations]]",
        'include-path-regex = "/cancel$"',
        f'parameters = {{ "path.execution_id" = {bind("cancellable")} }}',
        "",
        "[[operations]]",
        'include-path-regex = "/resume$"',
        f'parameters = {{ "path.execution_id" = {bind("resumable")} }}',
        "",
        "[[operations]]",
        'include-path-regex = "/values/"',
        f'parameters = {{ "path.execution_id" = {bind("owner")} }}',
        "",
    ]
    if authorization is not None:
        lines[:0] = ["[headers]", f'Authorization = "{authorization}"', ""]
    return "\n".join(lines)


async def schemathesis(url: str, config_path: Path, *, seconds: int) -> tuple[int, str]:
    """Run ``schemathesis run`` against the server; its exit code and output."""
    process = await asyncio.create_subprocess_exec(
        str(SCHEMATHESIS),
        "--config-file", str(config_path),
        "run", f"{url}/openapi.json",
        "--checks", CHECKS,
        "--phases", "examples,coverage,fuzzing",
        "--max-time", str(seconds),
        "--request-timeout", "5",
        # One worker: with several, hypothesis describes strategies by parsing source
        # in threads, and CPython 3.11's parser is not thread-safe ("AST constructor
        # recursion depth mismatch" errors in the report).
        "--workers", "1",
        "--generation-database", "none",
        "--no-color",
        cwd=config_path.parent,  # schemathesis keeps a .schemathesis/ cache there
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")


async def fuzz(
    server: FlowcastServer, client: httpx.AsyncClient, tmp: Path, *, seconds: int, auth: bool
) -> None:
    seeds = await seed(client)
    config_path = tmp / "schemathesis.toml"
    config_path.write_text(config(seeds, authorization=f"Bearer {KEY}" if auth else None))
    code, output = await schemathesis(server.url, config_path, seconds=seconds)
    print(output)  # shown with -rP: what was tested, even when all passed
    errors = [line for line in server.logs().splitlines() if '"level":"error"' in line]
    server_errors = "\n".join(errors[-50:])
    assert code == 0, f"schemathesis found problems:\n{output}\n--- server errors:\n{server_errors}"


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_schema_fuzzed_finds_no_server_error_and_no_off_schema_response(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    async with fuzz_server(tmp_path / "open", valkey) as (server, client):
        await fuzz(server, client, tmp_path / "open", seconds=9, auth=False)
    async with fuzz_server(tmp_path / "keyed", valkey, FLOWCAST_API_KEYS=KEY) as (
        server,
        client,
    ):
        await fuzz(server, client, tmp_path / "keyed", seconds=4, auth=True)
