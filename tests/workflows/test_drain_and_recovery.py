"""The executor's part of durable execution: checkpoint fields on its events, a drain
that hands the run off, and a run recovered from a checkpoint."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lib.errors import BlockError
from lib.workflows.blocks import BlockContext, BlockTypes
from lib.workflows.blocks.base import BlockServices
from lib.workflows.executor import BlockFailed, Executor, HandedOff, RunState
from lib.workflows.model import Workflow
from lib.workflows.templates import block_reads

from .conftest import Recorder, workflow

pytestmark = pytest.mark.timeout(30)


def step(block_id: str, name: str = "step", **extra: Any) -> dict[str, Any]:
    return {"id": block_id, "type": "python", "config": {"name": name}, **extra}


async def run(
    services: BlockServices,
    definition: dict[str, Any],
    handlers: dict[str, Any],
    *,
    state: RunState | None = None,
    drain: asyncio.Event | None = None,
) -> tuple[dict[str, Any], Recorder]:
    recorder = Recorder()
    executor = Executor(BlockTypes.builtin(handlers), services)
    output = await executor.run(
        Workflow.model_validate(definition),
        execution_id="ex_test",
        input=None,
        emit=recorder,
        state=state,
        drain=drain,
    )
    return output, recorder


async def test_every_event_that_moves_the_run_carries_its_checkpoint_fields(
    services: BlockServices,
) -> None:
    async def value(ctx: BlockContext, args: Any) -> Any:
        return {"from": ctx.block_id}

    definition = workflow(
        [step("a", "value"), step("b", "value")], [{"from": "a", "to": "b", "when": "false"}]
    )
    _, recorder = await run(services, definition, {"value": value})
    assert recorder.checkpoints == [
        ("t:a", b"1"),
        ("o:a", b'{"from":"a"}'),
        ("s:b", b"1"),
    ]


async def test_a_drain_lets_the_running_block_finish_and_hands_off_the_rest(
    services: BlockServices,
) -> None:
    drain = asyncio.Event()
    release = asyncio.Event()

    async def slow(ctx: BlockContext, args: Any) -> Any:
        drain.set()  # the shutdown arrives while this block runs
        await release.wait()
        return ctx.block_id

    async def fast(ctx: BlockContext, args: Any) -> Any:
        return ctx.block_id

    definition = workflow(
        [step("first", "slow"), step("second", "fast"), step("third", "fast")],
        [{"from": "first", "to": "second"}, {"from": "second", "to": "third"}],
    )
    task = asyncio.create_task(run(services, definition, {"slow": slow, "fast": fast}, drain=drain))
    await drain.wait()
    release.set()
    with pytest.raises(HandedOff) as handed:
        await task
    assert handed.value.deferred == ["second"]


async def test_a_recovered_run_reruns_only_the_unfinished_block_with_its_next_attempt(
    services: BlockServices,
) -> None:
    ran: list[tuple[str, int]] = []

    async def record(ctx: BlockContext, args: Any) -> Any:
        ran.append((ctx.block_id, ctx.attempt))
        return ctx.block_id

    state = RunState(
        outputs={"a": "a-kept"}, attempts={"a": 1, "b": 1}, recovered=True
    )  # b was in flight at the crash
    definition = workflow(
        [step("a", "record"), step("b", "record"), step("c", "record")],
        [{"from": "a", "to": "b"}, {"from": "b", "to": "c"}],
    )
    output, recorder = await run(services, definition, {"record": record}, state=state)
    assert ran == [("b", 2), ("c", 1)]
    assert output == {"c": "c"}
    assert recorder.kinds("a") == []
    assert [d["attempt"] for d in recorder.of("block:started")] == [2, 1]


async def test_the_retry_budget_counts_the_attempts_made_before_a_recovery(
    services: BlockServices,
) -> None:
    async def broken(ctx: BlockContext, args: Any) -> Any:
        raise BlockError("down", f"attempt {ctx.attempt}", retryable=True)

    definition = workflow([step("x", "broken", retry={"attempts": 3, "backoffMs": 0})])
    state = RunState(attempts={"x": 2}, recovered=True)
    with pytest.raises(BlockFailed, match="attempt 3"):
        await run(services, definition, {"broken": broken}, state=state)


@pytest.mark.parametrize(
    ("texts", "reads"),
    [
        (["{{ blocks.a.output }} and {{ blocks['b-1'].output.x }}"], {"a", "b-1"}),
        (['{{ blocks["c"].output }}', "{{ input.n }}"], {"c"}),
        (["{{ blocks[name].output }}"], None),
        (["{% for k in blocks %}{{ k }}{% endfor %}"], None),
        (["plain text"], set()),
    ],
)
def test_the_blocks_a_template_reads_are_found_or_all_are_assumed(
    texts: list[str], reads: set[str] | None
) -> None:
    assert block_reads(texts) == reads
