"""The workflow store against real Valkey: the workflow a start goes on with without
reading it first, and the read in the start's own round trip that confirms it is still
the stored one (step 15, the event path's latency: the workflow read was one of three
round trips before a stream's first frame)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from redis.asyncio import Redis

from lib.backend import Batch
from lib.errors import NotFound, WorkflowChanged
from lib.workflows.model import Workflow
from lib.workflows.store import StoredWorkflow, WorkflowStore

pytestmark = pytest.mark.timeout(30)


def definition(workflow_id: str, value: int) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "only", "type": "transform", "config": {"value": value}}],
    }


def value_of(workflow: Workflow) -> Any:
    return workflow.blocks[0].config["value"]


def replicas(redis: Redis, **options: Any) -> tuple[WorkflowStore, WorkflowStore]:
    """Two processes' stores on one Redis prefix."""
    prefix = f"t{uuid.uuid4().hex[:6]}"
    return tuple(  # type: ignore[return-value]
        WorkflowStore(redis=redis, validate=Workflow.model_validate, prefix=prefix, **options)
        for _ in range(2)
    )


async def confirm(
    store: WorkflowStore, redis: Redis, workflow_id: str, stored: StoredWorkflow | None = None
) -> None:
    """Confirm ``stored`` (the workflow ``store`` knows, by default) in a batch of its own."""
    stored = stored or store.known("t", workflow_id)
    assert stored is not None
    batch = Batch(redis)
    store.confirm_in(batch, "t", workflow_id, stored)
    await batch.send()


async def test_a_workflow_read_or_written_here_is_known_and_confirmed_while_unchanged(
    redis: Redis,
) -> None:
    here, there = replicas(redis)
    assert here.known("t", "wf") is None
    await there.put("t", "wf", definition("wf", 1))
    assert here.known("t", "wf") is None  # written by another process: not known here
    assert value_of((await here.get("t", "wf")).workflow) == 1
    known = here.known("t", "wf")
    assert known is not None and value_of(known.workflow) == 1
    await confirm(here, redis, "wf")
    await confirm(there, redis, "wf")  # its own write is known as stored
    await there.put("t", "wf", definition("wf", 1))  # the same definition stored again
    await confirm(here, redis, "wf")


async def test_a_workflow_another_process_replaced_or_deleted_is_not_confirmed(
    redis: Redis,
) -> None:
    here, there = replicas(redis)
    await here.put("t", "wf", definition("wf", 1))
    await there.put("t", "wf", definition("wf", 2))
    with pytest.raises(WorkflowChanged):
        await confirm(here, redis, "wf")
    assert here.known("t", "wf") is None  # forgotten: the next start reads it
    assert value_of((await here.get("t", "wf")).workflow) == 2
    await confirm(here, redis, "wf")
    await there.delete("t", "wf")
    with pytest.raises(WorkflowChanged):
        await confirm(here, redis, "wf")
    with pytest.raises(NotFound):
        await here.get("t", "wf")
    assert here.known("t", "wf") is None


async def test_a_file_workflow_is_confirmed_until_the_api_shadows_it(redis: Redis) -> None:
    files = {"wf": Workflow.model_validate(definition("wf", 1))}
    here, there = replicas(redis, files=files)
    assert (await here.get("t", "wf")).source == "file"
    await confirm(here, redis, "wf")
    await there.put("t", "wf", definition("wf", 2))
    with pytest.raises(WorkflowChanged):
        await confirm(here, redis, "wf")
    stored = await here.get("t", "wf")
    assert stored.source == "api" and value_of(stored.workflow) == 2
    await there.delete("t", "wf")  # the file shows again
    with pytest.raises(WorkflowChanged):
        await confirm(here, redis, "wf")
    assert (await here.get("t", "wf")).source == "file"
    await confirm(here, redis, "wf")


async def test_a_start_is_confirmed_against_the_workflow_it_went_on_with(
    redis: Redis,
) -> None:
    """What this process knows may move on while a start is under way (a put here, a
    read by another request): the start is judged against its own workflow."""
    here, _ = replicas(redis)
    await here.put("t", "wf", definition("wf", 1))
    went_on_with = here.known("t", "wf")
    assert went_on_with is not None
    await here.put("t", "wf", definition("wf", 2))
    with pytest.raises(WorkflowChanged):
        await confirm(here, redis, "wf", went_on_with)
    known = here.known("t", "wf")
    assert known is not None and value_of(known.workflow) == 2  # the newer one stays known
    await confirm(here, redis, "wf")
