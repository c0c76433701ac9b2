"""Traces (SPEC §15) exported to a real OTLP/HTTP receiver on 127.0.0.1: the execution
span and its block spans in one trace, an incoming ``traceparent`` parenting it, an
outbound ``http`` and ``llm`` calls carrying it; one trace across processes (a run
recovered after its owner was SIGKILLed, a run an API replica queued and a worker ran,
paused and resumed); a run accepted untraced stays so; Redis spans only when asked."""

from __future__ import annotations

import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import (
    approval_workflow,
    delay_workflow,
    execute,
    has_stored,
    put,
    until,
    wait_finished,
    wait_status,
)
from tests.support.faults import kill_replica, replica
from tests.support.llm import FakeLLM, llm, llm_block, one_block
from tests.support.otlp import Receiver, Span, otlp_receiver, traced_env
from tests.support.servers import FlowcastServer, FlowcastWorker, ValkeyServer, env_on, prefix

pytestmark = pytest.mark.timeout(90)
__all__ = ["llm"]  # the module's fake provider (tests/support/llm.py)


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as found:
        yield found


@pytest.fixture(scope="module")
async def traced(
    valkey: ValkeyServer,
    receiver: Receiver,
    llm: FakeLLM,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[FlowcastServer]:
    env = {
        **env_on(valkey, http_allow_private="true", llm_base_url=llm.url),
        **traced_env(receiver),
    }
    server = FlowcastServer(data_dir=tmp_path_factory.mktemp("traced"), env=env)
    await server.start()
    yield server
    await server.stop()


def _http_workflow(workflow_id: str, url: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "first", "type": "transform", "config": {"value": 1}},
            {"id": "call", "type": "http", "config": {"url": url}},
        ],
        "edges": [{"from": "first", "to": "call"}],
    }


MS_NS = 1_000_000  # timestamps have ms precision


def _ns(ts: str) -> int:
    moment = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


async def _execution_span(receiver: Receiver, execution_id: str) -> Span:
    def found() -> list[Span]:
        return receiver.named("flowcast.execution", **{"flowcast.execution.id": execution_id})

    spans: list[Span] = await until(found, f"the span of {execution_id}", timeout=20)
    assert len(spans) == 1, spans  # exported once
    return spans[0]


async def _span(receiver: Receiver, trace_id: str, span_id: str, what: str) -> Span:
    """The span ``span_id`` of ``trace_id``, once exported: each process exports its
    spans in batches of its own, so a parent can arrive after its child."""

    def found() -> list[Span]:
        return [s for s in receiver.of_trace(trace_id) if s.span_id == span_id]

    spans: list[Span] = await until(found, what, timeout=20)
    return spans[0]


async def test_an_execution_is_one_trace_with_a_span_per_block_attempt_and_its_outbound_call(
    traced: FlowcastServer, receiver: Receiver, unique: str
) -> None:
    hook = f"/hook-{unique}"
    async with httpx.AsyncClient(base_url=traced.url, timeout=20) as client:
        await put(client, _http_workflow(f"traced-{unique}", receiver.url + hook))
        execution_id = await execute(client, f"traced-{unique}", {})
        snapshot = await wait_finished(client, execution_id, timeout=20)
    assert snapshot["status"] == "completed", snapshot
    span = await _execution_span(receiver, execution_id)
    assert span.attributes["flowcast.workflow.id"] == f"traced-{unique}"
    assert span.attributes["flowcast.execution.status"] == "completed"
    assert span.resource["service.name"] == "flowcast-test"
    # From accepted to its terminal event.
    assert span.start_ns == _ns(snapshot["createdAt"])
    # Its terminal event's millisecond, to its end (timestamps have ms precision).
    assert span.end_ns == _ns(snapshot["updatedAt"]) + MS_NS - 1

    def blocks() -> list[Span]:
        found = receiver.named("flowcast.block", **{"flowcast.execution.id": execution_id})
        return found if len(found) == 2 else []

    by_id = {s.attributes["flowcast.block.id"]: s for s in await until(blocks, "2 block spans")}
    for block_id, block_type in (("first", "transform"), ("call", "http")):
        block = by_id[block_id]
        assert (block.trace_id, block.parent_id) == (span.trace_id, span.span_id)
        assert block.attributes["flowcast.block.type"] == block_type
        assert block.attributes["flowcast.block.attempt"] == 1
        assert block.attributes["flowcast.block.outcome"] == "completed"
        assert span.start_ns <= block.start_ns <= block.end_ns <= span.end_ns

    # The http block's request carried a traceparent of this trace, its client span's.
    headers = next(h for path, h in receiver.requests if path == hook)
    version, trace_id, parent_id, _flags = headers["traceparent"].split("-")
    assert (version, trace_id) == ("00", span.trace_id)
    client_span = await _span(receiver, span.trace_id, parent_id, "the outbound call's span")
    assert client_span.parent_id == by_id["call"].span_id

    # The execute request was served in a span of its own (FastAPI instrumentation).
    served = await _span(receiver, span.trace_id, span.parent_id, "the execute request's span")
    assert "execute" in served.name, served


async def test_an_llm_blocks_call_carries_the_traceparent_of_its_attempt(
    traced: FlowcastServer, receiver: Receiver, llm: FakeLLM, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=traced.url, timeout=20) as client:
        await put(client, one_block(f"asks-{unique}", llm_block("draft")))
        execution_id = await execute(client, f"asks-{unique}", {"n": 1})
        assert (await wait_finished(client, execution_id, timeout=20))["status"] == "completed"
    span = await _execution_span(receiver, execution_id)
    seen = [r for r in llm.requests if "traceparent" in r.headers]
    assert seen, "the provider was called with a traceparent"
    _version, trace_id, parent_id, _flags = seen[-1].headers["traceparent"].split("-")
    assert trace_id == span.trace_id

    def call() -> list[Span]:
        return [s for s in receiver.of_trace(trace_id) if s.span_id == parent_id]

    outbound = (await until(call, "the llm call's client span", timeout=20))[0]
    block = await _span(receiver, trace_id, outbound.parent_id, "the llm block's span")
    assert block.name == "flowcast.block"
    assert block.attributes["flowcast.block.type"] == "llm"
    assert block.parent_id == span.span_id


async def test_an_incoming_traceparent_parents_the_execution(
    traced: FlowcastServer, receiver: Receiver, unique: str
) -> None:
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    async with httpx.AsyncClient(base_url=traced.url, timeout=20) as client:
        await put(client, delay_workflow(f"parented-{unique}", ms=10))
        execution_id = await execute(
            client,
            f"parented-{unique}",
            {},
            headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
        )
        await wait_finished(client, execution_id, timeout=20)
    span = await _execution_span(receiver, execution_id)
    assert span.trace_id == trace_id
    # Its parent is the request that accepted it, itself the caller's span's child.
    request = await _span(receiver, trace_id, span.parent_id, "the execute request's span")
    assert request.parent_id == caller_span


@pytest.mark.parametrize(
    "header",
    [
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # the invalid all-zero trace id
        "00-" + "a" * 32 + "-" + "0" * 16 + "-01",  # the invalid all-zero span id
        "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",  # the forbidden version
        "00-" + "A" * 32 + "-" + "B" * 16 + "-01",  # upper case
        "00-xyz",
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + "-x" * 4000,  # 8 kB
    ],
    ids=["zero-trace", "zero-span", "version-ff", "upper", "short", "huge"],
)
async def test_a_malformed_traceparent_is_ignored_and_the_run_gets_a_trace_of_its_own(
    traced: FlowcastServer, receiver: Receiver, unique: str, header: str
) -> None:
    async with httpx.AsyncClient(base_url=traced.url, timeout=20) as client:
        await put(client, delay_workflow(f"badparent-{unique}", ms=10))
        execution_id = await execute(
            client, f"badparent-{unique}", {}, headers={"traceparent": header}
        )
        await wait_finished(client, execution_id, timeout=20)
    span = await _execution_span(receiver, execution_id)
    assert len(span.trace_id) == 32 and span.trace_id != "0" * 32
    assert span.trace_id not in header.lower(), "a malformed traceparent was followed"
    # Its parent is the request that accepted it, itself a root.
    request = await _span(receiver, span.trace_id, span.parent_id, "the execute request's span")
    assert not request.parent_id, request


async def test_a_run_recovered_after_its_owner_was_killed_stays_one_trace(
    valkey: ValkeyServer, receiver: Receiver, tmp_path: Path, unique: str
) -> None:
    shared = {"FLOWCAST_REDIS_PREFIX": prefix()}
    a = replica(valkey, tmp_path, "a", **shared, **traced_env(receiver, "a"))
    b = replica(valkey, tmp_path, "b", **shared, **traced_env(receiver, "b"))
    try:
        await a.start()
        await b.start()
        async with httpx.AsyncClient(base_url=a.url, timeout=20) as on_a:
            await put(on_a, delay_workflow(f"moved-{unique}", ms=2_000))
            execution_id = await execute(on_a, f"moved-{unique}", {})

            def hello_exported() -> list[Span]:
                return receiver.named(
                    "flowcast.block",
                    **{"flowcast.execution.id": execution_id, "flowcast.block.id": "hello"},
                )

            await until(lambda: has_stored(on_a, execution_id, "block:started"), "started", 20)
            await until(hello_exported, "A exported hello's span", timeout=20)
        await kill_replica(a)
        async with httpx.AsyncClient(base_url=b.url, timeout=20) as on_b:
            snapshot = await wait_finished(on_b, execution_id, timeout=40)
        assert snapshot["status"] == "completed", snapshot
        span = await _execution_span(receiver, execution_id)
        assert span.resource["flowcast.replica"] == "b"  # who stored its terminal event
        assert span.start_ns == _ns(snapshot["createdAt"])

        def blocks() -> list[Span]:
            found = receiver.named("flowcast.block", **{"flowcast.execution.id": execution_id})
            return (
                found
                if {"hello", "bye"} <= {s.attributes["flowcast.block.id"] for s in found}
                else []
            )

        found = await until(blocks, "the block spans of both processes", timeout=20)
        replicas = {
            s.attributes["flowcast.block.id"]: s.resource["flowcast.replica"] for s in found
        }
        assert replicas["hello"] == "a" and replicas["bye"] == "b", replicas
        for block in found:
            assert (block.trace_id, block.parent_id) == (span.trace_id, span.span_id)
    finally:
        await a.stop(signal.SIGKILL)
        await b.stop(signal.SIGKILL)


async def test_a_run_queued_by_an_api_replica_paused_and_resumed_on_a_worker_is_one_trace(
    valkey: ValkeyServer, receiver: Receiver, tmp_path: Path, unique: str
) -> None:
    env = env_on(valkey)
    api = FlowcastServer(
        data_dir=tmp_path / "api",
        env={**env, "FLOWCAST_WORKER_SLOTS": "0", **traced_env(receiver, "api")},
    )
    worker = FlowcastWorker(
        data_dir=tmp_path / "worker",
        env={**env, "FLOWCAST_WORKER_SLOTS": "4", **traced_env(receiver, "worker")},
    )
    try:
        await api.start()
        await worker.start()
        async with httpx.AsyncClient(base_url=api.url, timeout=20) as client:
            await put(client, approval_workflow(f"asked-{unique}"))
            execution_id = await execute(client, f"asked-{unique}", {})
            await wait_status(client, execution_id, "paused", timeout=20)
            resumed = await client.post(
                f"/api/executions/{execution_id}/resume", json={"input": {"ok": True}}
            )
            assert resumed.status_code == 202, resumed.text
            assert (await wait_finished(client, execution_id, timeout=20))["status"] == "completed"
        span = await _execution_span(receiver, execution_id)
        assert span.resource["flowcast.replica"] == "worker"
        accepted = await _span(receiver, span.trace_id, span.parent_id, "the api's execute span")
        assert accepted.resource["flowcast.replica"] == "api" and "execute" in accepted.name

        def blocks() -> list[Span]:
            found = receiver.named("flowcast.block", **{"flowcast.execution.id": execution_id})
            return found if len(found) == 3 else []

        found = await until(blocks, "review twice (asked, answered) and done", timeout=20)
        outcomes = sorted(
            (s.attributes["flowcast.block.id"], s.attributes["flowcast.block.outcome"])
            for s in found
        )
        assert outcomes == [("done", "completed"), ("review", "completed"), ("review", "paused")]
        for block in found:
            assert (block.trace_id, block.parent_id) == (span.trace_id, span.span_id)
            assert block.resource["flowcast.replica"] == "worker"
    finally:
        await api.stop()
        await worker.stop()


async def test_a_run_accepted_untraced_stays_untraced_on_a_traced_worker(
    valkey: ValkeyServer, receiver: Receiver, tmp_path: Path, unique: str
) -> None:
    env = env_on(valkey, http_allow_private="true")
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    worker = FlowcastWorker(
        data_dir=tmp_path / "worker",
        env={**env, "FLOWCAST_WORKER_SLOTS": "4", **traced_env(receiver, "late")},
    )
    hook = f"/untraced-{unique}"
    try:
        await api.start()
        await worker.start()
        async with httpx.AsyncClient(base_url=api.url, timeout=20) as client:
            await put(client, _http_workflow(f"untraced-{unique}", receiver.url + hook))
            execution_id = await execute(client, f"untraced-{unique}", {})
            assert (await wait_finished(client, execution_id, timeout=20))["status"] == "completed"
    finally:
        await api.stop()
        await worker.stop()  # its lifespan's end exports whatever is pending
    # Neither the block spans nor the outbound call's: no stray roots, no traceparent.
    headers = next(h for path, h in receiver.requests if path == hook)
    assert "traceparent" not in headers
    late = [s for s in receiver.spans if s.resource.get("flowcast.replica") == "late"]
    assert late == [], late


async def test_redis_commands_are_spans_only_when_asked(
    valkey: ValkeyServer, receiver: Receiver, tmp_path: Path, unique: str
) -> None:
    env = {**env_on(valkey, traces_redis="true"), **traced_env(receiver, "redis")}
    server = FlowcastServer(data_dir=tmp_path / "redis", env=env)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            await put(client, delay_workflow(f"redis-{unique}", ms=10))
            execution_id = await execute(client, f"redis-{unique}", {})
            await wait_finished(client, execution_id, timeout=20)
        span = await _execution_span(receiver, execution_id)

        def commands() -> list[Span]:
            return [
                s
                for s in receiver.of_trace(span.trace_id)
                if s.attributes.get("db.system") == "redis"
                or s.attributes.get("db.system.name") == "redis"
            ]

        # The run's writes (its events) are Redis spans in its trace.
        assert await until(commands, "redis spans in the execution's trace", timeout=20)
    finally:
        await server.stop()
    # The server without the setting (the module's) exported no Redis span at all.
    others = [s for s in receiver.spans if s.resource.get("flowcast.replica") == "a"]
    assert others and not any("db.system" in s.attributes for s in others)
