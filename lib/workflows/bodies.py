"""What a run does between its log opening and closing, by kind: a new execution from
its first event, a resume from its answer, and an execution cancelled while it waited
in line (the endings of a takeover or an expiry are in takeovers.py and janitor.py).

Each is handed to ``Launcher.launch`` by the runner or the dispatcher, whoever won the
claim that makes this process the owner.
"""

from __future__ import annotations

from typing import Any

from lib.execution.events import (
    EXECUTION_CANCELLED,
    EXECUTION_FAILED,
    EXECUTION_RESUMED,
    EXECUTION_STARTED,
)
from lib.execution.log import ExecutionLog
from lib.workflows.checkpoint import answer_field
from lib.workflows.launcher import Body, Launcher, Opening, Outcome
from lib.workflows.leases import LocalRun
from lib.workflows.model import Workflow
from lib.workflows.runstate import RunStates
from lib.workflows.takeovers import load_run


def new_run(
    launcher: Launcher, workflow: Workflow, input: Any, saved: dict[str, bytes], queued_ms: int
) -> tuple[Opening, Body]:
    """A new execution: ``execution:started`` (with how long it waited in line) as the
    run opens, then the workflow from its first block."""

    def opening(local: LocalRun, emitter: ExecutionLog) -> None:
        emitter.emit(EXECUTION_STARTED, {"input": input, "queuedMs": queued_ms})
        emitter.remember(saved)
        local.workflow = workflow

    async def body(local: LocalRun, emitter: ExecutionLog) -> None:
        async def work() -> Outcome:
            return await launcher.run_workflow(local, emitter, workflow, input, None)

        await launcher.execute(local, emitter, work)

    return opening, body


def resumed(launcher: Launcher, states: RunStates, paused_at: str, input: Any) -> Body:
    """A resume: ``execution:resumed`` with the answer, then on from the checkpoint."""

    async def body(local: LocalRun, emitter: ExecutionLog) -> None:
        # First, whatever follows: the resume took effect even if a cancel stops the
        # run before its work begins. The answer goes into the checkpoint with it (as a
        # ref when large), so a recovery after this point still has it.
        kept, kept_json = await local.keeper.keep(input)
        checkpoint = answer_field(paused_at, kept_json)
        emitter.emit(EXECUTION_RESUMED, {"blockId": paused_at, "input": kept}, checkpoint)

        async def work() -> Outcome:
            workflow, given, run = await load_run(launcher, states, local, emitter)
            run.answers[paused_at] = kept
            return await launcher.run_workflow(local, emitter, workflow, given, run)

        await launcher.execute(local, emitter, work)

    return body


def cancelled_in_line(given: Any, queued_ms: int) -> Body:
    """An execution cancelled while queued (for ``queued_ms``): it never ran, yet its
    log starts as every log does (id 1 ``execution:started``), then ends cancelled."""

    async def body(local: LocalRun, emitter: ExecutionLog) -> None:
        emitter.emit(EXECUTION_STARTED, {"input": given, "queuedMs": queued_ms})
        emitter.emit(EXECUTION_CANCELLED, {"reason": "cancelled"})

    return body


# ``workflow_lost``'s input for a run whose log has begun already (a resume in line).
NOT_STARTED: Any = object()


def workflow_lost(given: Any, queued_ms: int) -> Body:
    """A queued execution whose workflow the store lost, and the tenant's stored one
    changed or went too: it cannot run, and ends failed (``workflow_lost``) instead of
    waiting for good. A start's log begins as every log does (``given``: its input);
    a resume in line has begun already (``NOT_STARTED``)."""

    async def body(local: LocalRun, emitter: ExecutionLog) -> None:
        if given is not NOT_STARTED:
            emitter.emit(EXECUTION_STARTED, {"input": given, "queuedMs": queued_ms})
        error = {
            "code": "workflow_lost",
            "message": "the store lost this execution's workflow version and the workflow "
            "was changed or deleted since; start it again",
        }
        emitter.emit(EXECUTION_FAILED, {"error": error})

    return body
