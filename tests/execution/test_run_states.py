"""RunStates against a real Valkey: workflow versions are content-addressed, so one
read and validated once serves every later run of it in the process, within a bound
of the bytes kept."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

from lib.errors import NotFound
from lib.execution.buffer import EventBuffer
from lib.execution.values import LocalValueStore
from lib.workflows import runstate
from lib.workflows.model import Workflow
from lib.workflows.runstate import RunStates

pytestmark = pytest.mark.timeout(30)


def workflow(workflow_id: str, text: str = "x") -> Workflow:
    block = {"id": "t", "type": "transform", "config": {"value": text}}
    return Workflow.model_validate({"id": workflow_id, "blocks": [block], "edges": []})


def states(redis: Redis, tmp_path: Path) -> RunStates:
    buffer = EventBuffer(redis=redis, prefix=f"rs{uuid.uuid4().hex[:6]}")
    return RunStates(buffer=buffer, values=LocalValueStore(root=tmp_path))


async def test_a_version_read_once_is_not_read_again(redis: Redis, tmp_path: Path) -> None:
    runs = states(redis, tmp_path)
    digest = await runs.save_version(workflow("once"))
    first = await runs.load_version(digest)
    await redis.delete(runs._keys.workflow_version(digest))
    assert await runs.load_version(digest) is first  # from memory: the store has none now
    with pytest.raises(NotFound):
        await states(redis, tmp_path).load_version(digest)  # another process reads it


async def test_the_versions_kept_stay_within_their_byte_bound(
    redis: Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runstate, "VERSION_CACHE_BYTES", 2_000)
    runs = states(redis, tmp_path)
    digests = [await runs.save_version(workflow(f"v{i}", "y" * 500)) for i in range(6)]
    for digest in digests:
        await runs.load_version(digest)
    assert runs._version_bytes <= 2_000
    assert list(runs._versions) == digests[-len(runs._versions) :]  # the newest kept
    assert len(runs._versions) < len(digests)
