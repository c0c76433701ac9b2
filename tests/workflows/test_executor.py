from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest

from lib.errors import BlockError
from lib.workflows.blocks import BlockContext
from lib.workflows.executor import BlockFailed, Paused, RunState

from .conftest import Recorder, RunWorkflow, workflow


def transform(block_id: str, value: Any = None, **extra: Any) -> dict[str, Any]:
    return {"id": block_id, "type": "transform", "config": {"value": value}, **extra}


def plugin(block_id: str, name: str, args: Any = None, **extra: Any) -> dict[str, Any]:
    config = {"name": name} if args is None else {"name": name, "args": args}
    return {"id": block_id, "type": "python", "config": config, **extra}


async def test_blocks_run_in_dependency_order_and_sinks_form_the_output(
    run_workflow: RunWorkflow,
) -> None:
    definition = workflow(
        [
            transform("c", "{{ blocks.b.output }}!"),
            transform("a", "{{ input.word }}"),
            transform("b", "{{ blocks.a.output | upper }}"),
        ],
        [{"from": "a", "to": "b"}, {"from": "b", "to": "c"}],
    )
    output, recorder = await run_workflow(definition, input={"word": "hi"})
    assert output == {"c": "HI!"}
    completed = [data["blockId"] for data in recorder.of("block:completed")]
    assert completed == ["a", "b", "c"]
    assert recorder.kinds("a") == ["block:started", "block:completed"]
    started = recorder.of("block:started", "b")[0]
    assert started == {"blockId": "b", "blockType": "transform", "attempt": 1}
    assert recorder.of("block:completed", "c")[0]["durationMs"] >= 0


async def test_parallelism_never_exceeds_the_concurrency_limit(run_workflow: RunWorkflow) -> None:
    active = 0
    peak = 0

    async def track(ctx: BlockContext, args: Any) -> Any:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        for _ in range(10):
            await asyncio.sleep(0)
        active -= 1
        return ctx.block_id

    blocks = [plugin(f"b{i}", "track") for i in range(12)]
    output, _ = await run_workflow(workflow(blocks), plugins={"track": track}, concurrency=3)
    assert peak == 3
    assert len(output) == 12


async def test_independent_blocks_run_in_parallel(run_workflow: RunWorkflow) -> None:
    both_started = asyncio.Event()
    arrived = 0

    async def meet(ctx: BlockContext, args: Any) -> Any:
        nonlocal arrived
        arrived += 1
        if arrived == 2:
            both_started.set()
        await both_started.wait()  # deadlocks (and times out) if run one after the other
        return None

    blocks = [plugin("x", "meet"), plugin("y", "meet")]
    await run_workflow(workflow(blocks), plugins={"meet": meet})


async def test_shared_upstream_runs_once(run_workflow: RunWorkflow) -> None:
    calls: list[str] = []

    async def count(ctx: BlockContext, args: Any) -> Any:
        calls.append(ctx.block_id)
        return len(calls)

    definition = workflow(
        [plugin("root", "count"), plugin("l", "count"), plugin("r", "count"), plugin("d", "count")],
        [
            {"from": "root", "to": "l"},
            {"from": "root", "to": "r"},
            {"from": "l", "to": "d"},
            {"from": "r", "to": "d"},
        ],
    )
    output, recorder = await run_workflow(definition, plugins={"count": count})
    assert sorted(calls) == ["d", "l", "r", "root"]
    assert calls[0] == "root" and calls[-1] == "d"
    assert output == {"d": 4}
    assert len(recorder.of("block:started", "root")) == 1


async def test_edge_condition_false_skips_downstream(run_workflow: RunWorkflow) -> None:
    definition = workflow(
        [transform("a", 1), transform("b", 2), transform("c", 3), transform("d", 4)],
        [
            {"from": "a", "to": "b", "when": "input.go"},
            {"from": "b", "to": "c"},
            {"from": "a", "to": "d"},
            {"from": "b", "to": "d"},
        ],
    )
    output, recorder = await run_workflow(definition, input={"go": False})
    assert recorder.of("block:skipped") == [
        {"blockId": "b", "reason": "every incoming edge's condition was false"},
        {"blockId": "c", "reason": "every upstream block was skipped"},
    ]
    # d has one taken edge (from a), so it runs even though b was skipped.
    assert output == {"d": 4}


async def test_edge_condition_true_runs_downstream(run_workflow: RunWorkflow) -> None:
    definition = workflow(
        [transform("a", {"approved": True}), transform("b", "sent")],
        [{"from": "a", "to": "b", "when": "blocks.a.output.approved"}],
    )
    output, recorder = await run_workflow(definition)
    assert output == {"b": "sent"}
    assert recorder.of("block:skipped") == []


async def test_templates_only_see_upstream_outputs(run_workflow: RunWorkflow) -> None:
    definition = workflow(
        [transform("a", "A"), transform("b", "{{ blocks.a.output }}")],
    )
    output, _ = await run_workflow(definition)
    assert output == {"a": "A", "b": None}


async def test_retry_emits_will_retry_until_an_attempt_succeeds(run_workflow: RunWorkflow) -> None:
    async def flaky(ctx: BlockContext, args: Any) -> Any:
        if ctx.attempt < 3:
            raise BlockError("busy", f"attempt {ctx.attempt} failed")
        return "done"

    block = plugin("f", "flaky", retry={"attempts": 5, "backoffMs": 20})
    started = time.monotonic()
    output, recorder = await run_workflow(workflow([block]), plugins={"flaky": flaky})
    assert time.monotonic() - started >= 0.02 + 0.04  # the two backoffs, a lower bound
    assert output == {"f": "done"}
    assert recorder.kinds("f") == [
        "block:started",
        "block:failed",
        "block:started",
        "block:failed",
        "block:started",
        "block:completed",
    ]
    failures = recorder.of("block:failed")
    assert [(f["attempt"], f["willRetry"]) for f in failures] == [(1, True), (2, True)]
    assert failures[0]["error"] == {"code": "busy", "message": "attempt 1 failed"}
    assert [s["attempt"] for s in recorder.of("block:started")] == [1, 2, 3]


async def test_exhausted_retries_fail_the_execution(run_workflow: RunWorkflow) -> None:
    async def down(ctx: BlockContext, args: Any) -> Any:
        raise BlockError("down", "still down")

    block = plugin("f", "down", retry={"attempts": 2, "backoffMs": 0})
    recorder = Recorder()
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]), plugins={"down": down}, recorder=recorder)
    assert (caught.value.block_id, caught.value.code, caught.value.message) == (
        "f",
        "down",
        "still down",
    )
    assert caught.value.as_error() == {"code": "down", "message": "still down", "blockId": "f"}
    assert [f["willRetry"] for f in recorder.of("block:failed")] == [True, False]


async def test_non_retryable_error_is_not_retried(run_workflow: RunWorkflow) -> None:
    recorder = Recorder()
    block = {
        "id": "boom",
        "type": "fail",
        "config": {"message": "no {{ input.what }}"},
        "retry": {"attempts": 5, "backoffMs": 0},
    }
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]), input={"what": "way"}, recorder=recorder)
    assert caught.value.code == "block_failed"
    assert caught.value.message == "no way"
    assert len(recorder.of("block:started")) == 1
    assert recorder.of("block:failed")[0]["willRetry"] is False


async def test_retry_after_is_a_lower_bound_on_the_wait(run_workflow: RunWorkflow) -> None:
    async def throttled(ctx: BlockContext, args: Any) -> Any:
        if ctx.attempt == 1:
            raise BlockError("http_status", "429", retry_after=0.2)
        return "ok"

    block = plugin("t", "throttled", retry={"attempts": 2, "backoffMs": 0})
    started = time.monotonic()
    await run_workflow(workflow([block]), plugins={"throttled": throttled})
    assert time.monotonic() - started >= 0.2


async def test_timeout_fails_the_attempt_and_is_retried(run_workflow: RunWorkflow) -> None:
    async def hang(ctx: BlockContext, args: Any) -> Any:
        await asyncio.Event().wait()

    block = plugin("h", "hang", timeoutMs=20, retry={"attempts": 2, "backoffMs": 0})
    recorder = Recorder()
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]), plugins={"hang": hang}, recorder=recorder)
    assert caught.value.code == "timeout"
    assert [f["willRetry"] for f in recorder.of("block:failed")] == [True, False]


async def test_unexpected_exception_becomes_block_error_and_is_logged(
    run_workflow: RunWorkflow, caplog: pytest.LogCaptureFixture
) -> None:
    async def buggy(ctx: BlockContext, args: Any) -> Any:
        raise KeyError("oops")

    with caplog.at_level(logging.ERROR), pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([plugin("b", "buggy")]), plugins={"buggy": buggy})
    assert caught.value.code == "block_error"
    assert "KeyError" in caught.value.message
    assert any(record.exc_info for record in caplog.records)


async def test_bad_rendered_config_is_bad_config(run_workflow: RunWorkflow) -> None:
    block = {"id": "d", "type": "delay", "config": {"ms": "{{ input.ms }}"}}
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(workflow([block]), input={"ms": "soon"})
    assert caught.value.code == "bad_config"
    assert "config.ms" in caught.value.message


async def test_rendered_numeric_template_is_used(run_workflow: RunWorkflow) -> None:
    block = {"id": "d", "type": "delay", "config": {"ms": "{{ input.ms }}"}}
    output, _ = await run_workflow(workflow([block]), input={"ms": 1})
    assert output == {"d": {"waitedMs": 1}}


async def test_failure_cancels_running_siblings(run_workflow: RunWorkflow) -> None:
    cancelled = asyncio.Event()
    running = asyncio.Event()

    async def wait_forever(ctx: BlockContext, args: Any) -> Any:
        running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def fail_when_running(ctx: BlockContext, args: Any) -> Any:
        await running.wait()
        raise BlockError("nope", "failed", retryable=False)

    definition = workflow(
        [plugin("slow", "wait"), plugin("bad", "fail"), transform("after", 1)],
        [{"from": "slow", "to": "after"}],
    )
    before = asyncio.all_tasks()
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(definition, plugins={"wait": wait_forever, "fail": fail_when_running})
    assert caught.value.block_id == "bad"
    assert cancelled.is_set()
    assert asyncio.all_tasks() == before


async def test_cancelling_the_run_cancels_its_blocks(run_workflow: RunWorkflow) -> None:
    running = asyncio.Event()
    cancelled = asyncio.Event()

    async def wait_forever(ctx: BlockContext, args: Any) -> Any:
        running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.create_task(
        run_workflow(workflow([plugin("w", "wait")]), plugins={"wait": wait_forever})
    )
    await running.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()


async def test_skipped_sinks_are_left_out_of_the_output(run_workflow: RunWorkflow) -> None:
    definition = workflow(
        [transform("a", 1), transform("yes", 2), transform("no", 3)],
        [{"from": "a", "to": "yes"}, {"from": "a", "to": "no", "when": "false"}],
    )
    output, _ = await run_workflow(definition)
    assert output == {"yes": 2}


async def test_chunks_are_emitted_as_block_chunk_events(run_workflow: RunWorkflow) -> None:
    async def talk(ctx: BlockContext, args: Any) -> Any:
        ctx.emit_chunk("one ")
        ctx.emit_chunk("")
        ctx.emit_chunk("two")
        return None

    _, recorder = await run_workflow(workflow([plugin("t", "talk")]), plugins={"talk": talk})
    assert recorder.of("block:chunk") == [
        {"blockId": "t", "text": "one "},
        {"blockId": "t", "text": "two"},
    ]


def approval(block_id: str, **config: Any) -> dict[str, Any]:
    schema = {"type": "object", "required": ["approved"]}
    return {
        "id": block_id,
        "type": "approval",
        "config": {"prompt": "ok?", "schema": schema, **config},
    }


async def test_approval_pauses_its_branch_while_independent_blocks_finish(
    run_workflow: RunWorkflow,
) -> None:
    definition = workflow(
        [
            transform("a", 1),
            approval("review", timeoutSeconds=60),
            transform("send", 2),
            transform("side", 3),
        ],
        [
            {"from": "a", "to": "review"},
            {"from": "review", "to": "send"},
            {"from": "a", "to": "side"},
        ],
    )
    with pytest.raises(Paused) as caught:
        await run_workflow(definition)
    pause, state = caught.value.pause, caught.value.state
    assert pause.block_id == "review" and pause.prompt == "ok?" and pause.timeout_seconds == 60
    assert state.outputs == {"a": 1, "side": 3}
    assert "send" not in state.outputs


async def test_resuming_gives_the_answer_as_the_approval_output_and_carries_on(
    run_workflow: RunWorkflow,
) -> None:
    definition = workflow(
        [
            transform("a", 1),
            approval("review"),
            transform("send", {"ok": "{{ blocks.review.output.approved }}"}),
            transform("side", 3),
        ],
        [
            {"from": "a", "to": "review"},
            {"from": "review", "to": "send", "when": "blocks.review.output.approved"},
            {"from": "a", "to": "side"},
        ],
    )
    with pytest.raises(Paused) as caught:
        await run_workflow(definition)
    state = caught.value.state
    state.answers["review"] = {"approved": True}
    resumed = RunState.from_json(orjson.loads(orjson.dumps(state.to_json())))
    output, recorder = await run_workflow(definition, state=resumed)
    assert output == {"send": {"ok": True}, "side": 3}
    # Only the frontier runs again; the approval does not announce a second start.
    assert recorder.kinds("a") == [] and recorder.kinds("side") == []
    assert recorder.kinds("review") == ["block:completed"]
    assert recorder.of("block:completed", "review")[0]["output"] == {"approved": True}


async def test_two_pending_approvals_pause_one_at_a_time_in_workflow_order(
    run_workflow: RunWorkflow,
) -> None:
    definition = workflow([approval("first"), approval("second")])
    with pytest.raises(Paused) as caught:
        await run_workflow(definition)
    assert caught.value.pause.block_id == "first"
    state = caught.value.state
    state.answers["first"] = {"approved": True}
    with pytest.raises(Paused) as again:
        await run_workflow(definition, state=state)
    assert again.value.pause.block_id == "second"
    assert again.value.state.outputs == {"first": {"approved": True}}


async def test_a_plugin_can_ask_for_approval_and_gets_the_answer_when_run_again(
    run_workflow: RunWorkflow,
) -> None:
    async def ask(ctx: BlockContext, args: Any) -> Any:
        answer = ctx.request_approval("go?", {"type": "object"})
        return {"answer": answer}

    definition = workflow([plugin("p", "ask")])
    with pytest.raises(Paused) as caught:
        await run_workflow(definition, plugins={"ask": ask})
    state = caught.value.state
    state.answers["p"] = {"go": 1}
    output, _ = await run_workflow(definition, plugins={"ask": ask}, state=state)
    assert output == {"p": {"answer": {"go": 1}}}
