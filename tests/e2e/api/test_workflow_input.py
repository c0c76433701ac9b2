"""A workflow declares its input (SPEC §9, issue 26): ``inputSchema`` and ``exampleInput``.

Both are stored with the workflow and read back as stored; a schema Flowcast cannot
run and an example the schema refuses are 422 with their JSON path when the workflow
is stored; an input the schema refuses is 422 at execute with the path and message,
and nothing is created or counted. Real processes throughout: a Flowcast server on
the session's Valkey, plain HTTP clients.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app.auth import tenant_of_key
from lib.backend import Keys
from tests.support.api import execute, put, wait_finished
from tests.support.loopwatch import loop_watch, worst
from tests.support.servers import ALPHA, BETA, ValkeyServer, authed, flowcast_on, prefix, serving
from tests.support.timing import assert_within, latencies, probing

ROOT = Path(__file__).resolve().parents[3]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["amount", "customer"],
    "properties": {
        "amount": {"type": "integer", "minimum": 1},
        "customer": {"type": "string", "minLength": 1},
    },
}
EXAMPLE = {"amount": 40, "customer": "Zed"}


def declared(workflow_id: str, **fields: Any) -> dict[str, Any]:
    """A one-block workflow that echoes its input, with the given top-level fields."""
    block = {"id": "echo", "type": "transform", "config": {"value": "{{ input }}"}}
    return {"id": workflow_id, "blocks": [block], "edges": [], **fields}


def problems(response: httpx.Response) -> dict[str, str]:
    """A 422's problems as ``{path: message}``."""
    assert response.status_code == 422, response.text
    return {item["path"]: item["message"] for item in response.json()["error"]["problems"]}


@pytest.mark.timeout(30)
async def test_a_workflow_keeps_its_input_schema_and_example_as_stored(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"declared-{unique}"
    stored = await client.put(
        f"/api/workflows/{workflow_id}",
        json=declared(workflow_id, inputSchema=SCHEMA, exampleInput=EXAMPLE),
    )
    assert stored.status_code == 201, stored.text
    read = (await client.get(f"/api/workflows/{workflow_id}")).json()
    assert read["inputSchema"] == SCHEMA
    assert read["exampleInput"] == EXAMPLE
    # An example alone (no schema) is kept too; a workflow with neither has neither.
    alone = declared(f"example-{unique}", exampleInput=[1, "two"])
    await put(client, alone)
    assert (await client.get(f"/api/workflows/example-{unique}")).json()["exampleInput"] == [
        1,
        "two",
    ]
    await put(client, declared(f"plain-{unique}"))
    read_plain = (await client.get(f"/api/workflows/plain-{unique}")).json()
    assert "inputSchema" not in read_plain and "exampleInput" not in read_plain


@pytest.mark.timeout(30)
async def test_a_schema_flowcast_cannot_run_is_refused_with_its_path(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"bad-schema-{unique}"
    cases: list[tuple[Any, str, str]] = [
        ({"properties": {"n": {"type": "nope"}}}, "$.inputSchema.properties.n.type", "nope"),
        ({"$ref": "https://example.com/s.json"}, "$.inputSchema", "points outside"),
        ({"type": "string", "pattern": "(a)\\1"}, "$.inputSchema", "not supported"),
        ({"items": {"$ref": "#/$defs/item"}}, "$.inputSchema", "points to nothing"),
        ("a string", "$.inputSchema", "object"),
    ]
    for schema, path, words in cases:
        answer = await client.put(
            f"/api/workflows/{workflow_id}", json=declared(workflow_id, inputSchema=schema)
        )
        found = problems(answer)
        assert path in found, (schema, found)
        assert words in found[path], (schema, found)
    assert (await client.get(f"/api/workflows/{workflow_id}")).status_code == 404


@pytest.mark.timeout(30)
async def test_an_example_the_schema_refuses_is_refused_with_its_path(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"bad-example-{unique}"
    answer = await client.put(
        f"/api/workflows/{workflow_id}",
        json=declared(workflow_id, inputSchema=SCHEMA, exampleInput={"amount": 0}),
    )
    found = problems(answer)
    assert "$.exampleInput.amount" in found, found
    assert "minimum" in found["$.exampleInput.amount"], found
    assert "'customer' is a required property" in found["$.exampleInput"], found
    assert (await client.get(f"/api/workflows/{workflow_id}")).status_code == 404


@pytest.mark.timeout(60)
async def test_an_input_the_schema_refuses_is_422_with_its_path_and_creates_nothing(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path
) -> None:
    """The refusal comes before anything is written: no execution is listed, the
    tenant's storage ledger names nothing more, and a repeat under the same
    Idempotency-Key is refused again; a valid input then runs."""
    own = prefix()
    async with (
        serving(valkey, tmp_path, api_keys=ALPHA, redis_prefix=own) as server,
        authed(server, ALPHA) as alpha,
    ):
        await put(alpha, declared("order", inputSchema=SCHEMA, exampleInput=EXAMPLE))
        ledger, _sizes = Keys(own).quota(tenant_of_key(ALPHA))
        counted = await redis.zcard(ledger)
        bodies: list[Any] = [
            {"input": {"amount": "40", "customer": "Zed"}},
            {"input": None},
            {},
        ]
        for index, body in enumerate(bodies):
            for headers in (
                {},
                {"Idempotency-Key": f"key-{index}"},
                {"Idempotency-Key": f"key-{index}"},
            ):
                answer = await alpha.post(
                    "/api/workflows/order/execute", json=body, headers=headers
                )
                found = problems(answer)
                if body.get("input"):
                    assert found == {"$.input.amount": "'40' is not of type 'integer'"}, found
                else:
                    assert list(found) == ["$.input"], found
                assert "inputSchema" in answer.json()["error"]["message"]
        streamed = await alpha.post(
            "/api/workflows/order/execute",
            json={"input": {"amount": -1, "customer": "Zed"}},
            headers={"Accept": "text/event-stream"},
        )
        assert "$.input.amount" in problems(streamed)
        assert (await alpha.get("/api/executions")).json()["executions"] == []
        assert await redis.zcard(ledger) == counted

        run = await execute(alpha, "order", EXAMPLE)
        ended = await wait_finished(alpha, run)
        assert ended["status"] == "completed", ended
        assert ended["output"] == {"echo": EXAMPLE}


# A ten-megabyte input: five million zeros.
ZEROS = 5_000_000
# Against a 40-deep input, both array branches descend at every level: 2**40 steps,
# cut at the CPU bound.
SPLITTING: dict[str, Any] = {
    "anyOf": [
        {"type": "array", "items": {"$ref": "#"}, "minItems": 2},
        {"type": "array", "items": {"$ref": "#"}},
        {"type": "string"},
    ]
}
# Measured beside three such checks: another tenant's worst GET 0.1-0.3 s over a
# 5-20 ms probe; the loop's worst hold of its CPU within one bucket of the quiet one.
STALL_RATIO, STALL_FLOOR = 10.0, 1.5
HOLD_RATIO, HOLD_FLOOR = 2.0, 0.09


@pytest.mark.timeout(180)
async def test_a_large_input_checked_against_a_schema_does_not_hold_the_event_loop(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """Four 10 MB inputs at once, each against a schema that costs what the input does
    (every item's type: stopped at the CPU bound; whole-array keywords; the array in the
    message), and a 40-deep one against a schema that splits at every level (stopped at
    the CPU bound): each is 422 with a short message, while another tenant's GETs
    stay within a small ratio of their quiet probe and the loop's worst hold of its CPU
    within one bucket of the quiet one (SPEC §8: "no tenant's data holds the event
    loop")."""
    server = await flowcast_on(
        valkey, tmp_path / "loop", api_keys=f"{ALPHA},{BETA}", loop_watch_ms="2"
    )
    schemas: dict[str, dict[str, Any]] = {
        "each": {"type": "array", "items": {"type": "string"}, "minItems": ZEROS + 1},
        "items": {"type": "array", "items": {"type": "integer", "maximum": 0}},
        "whole": {"type": "object"},
        "unique": {"type": "array", "uniqueItems": True},
        "deep": SPLITTING,
    }
    body = b'{"input":[' + b",".join([b"0"] * ZEROS) + b"]}"
    deep = b'{"input":' + b"[" * 40 + b"0" + b"]" * 40 + b"}"
    try:
        async with authed(server, ALPHA) as alpha, authed(server, BETA) as beta:
            for name, schema in schemas.items():
                await put(alpha, declared(name, inputSchema=schema))
            await put(beta, declared("probe"))
            started = await loop_watch(beta)
            quiet = await latencies(beta, "/api/workflows", 40)
            before = await loop_watch(beta)

            async def send(name: str) -> httpx.Response:
                return await alpha.post(
                    f"/api/workflows/{name}/execute",
                    content=deep if name == "deep" else body,
                    headers={"content-type": "application/json"},
                    timeout=120,
                )

            async with probing(beta, "/api/workflows") as loaded:
                answers = await asyncio.gather(*(send(name) for name in schemas))
            after = await loop_watch(beta)
        for name, answer in zip(schemas, answers, strict=True):
            found = problems(answer)
            assert len(answer.content) < 16_000, (name, len(answer.content))
            assert found, name
        assert "took too long" in problems(answers[1])["$.input"]
        assert "5000000 items" in problems(answers[2])["$.input"]
        assert "non-unique" in problems(answers[3])["$.input"]
        assert "took too long" in problems(answers[4])["$.input"]
        assert_within(
            max(loaded),
            probe=max(quiet),
            ratio=STALL_RATIO,
            floor=STALL_FLOOR,
            what=f"another tenant's worst GET of {len(loaded)} beside five large inputs checked",
        )
        assert_within(
            worst(before, after, "held"),
            probe=worst(started, before, "held"),
            ratio=HOLD_RATIO,
            floor=HOLD_FLOOR,
            what="the loop's worst hold of its CPU beside five large inputs checked",
        )
    finally:
        await server.stop(signal.SIGKILL)


@pytest.mark.timeout(30)
async def test_workflow_files_carry_them_and_the_openapi_schema_shows_them(
    client: httpx.AsyncClient,
) -> None:
    """The shipped examples declare both (read from FLOWCAST_WORKFLOWS_DIR); the API's
    schema documents them on the stored document and on the PUT body."""
    shipped = json.loads((ROOT / "examples" / "approve-refund.json").read_text())
    read = (await client.get("/api/workflows/approve-refund")).json()
    assert read["source"] == "file"
    assert read["inputSchema"] == shipped["inputSchema"]
    assert read["exampleInput"] == shipped["exampleInput"]
    for path in sorted((ROOT / "examples").glob("*.json")):
        assert "exampleInput" in json.loads(path.read_text()), path.name
    document = (await client.get("/openapi.json")).json()
    stored = document["components"]["schemas"]["WorkflowDocument"]["properties"]
    put_body = document["paths"]["/api/workflows/{workflow_id}"]["put"]["requestBody"]
    body = put_body["content"]["application/json"]["schema"]["properties"]
    for name in ("inputSchema", "exampleInput"):
        assert name in stored and name in body, name
        assert "description" in body[name], body[name]
