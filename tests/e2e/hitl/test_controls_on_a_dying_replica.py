"""A cancel or a resume answered 202 by a replica that dies right after still takes
effect (SPEC §7): whoever recovers the paused execution finds the claim and honours it.
With real processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.support.api import approval_workflow, execute, put, until, wait_status, within
from tests.support.servers import FlowcastServer, ValkeyServer

# ---------------------------------------------------------------- a 202, then the replica dies


async def _accepted_then_died(
    valkey: ValkeyServer,
    prefix: str,
    execution_id: str,
    mode: str,
    block_id: str = "",
    answer: bytes = b"",
) -> None:
    """What Redis holds once a replica has answered 202 to a resume or a cancel of a
    paused execution and died before writing anything more (SIGKILL, OOM, a lost
    machine, between the claim and the next write): its lease watched, its claim won
    (exactly the calls Runner._claim makes before the 202)."""
    from lib.execution.buffer import EventBuffer
    from tests.support.ownership import ownership_parts

    redis = Redis.from_url(valkey.url)
    try:
        parts = ownership_parts(EventBuffer(redis=redis, prefix=prefix), 1)
        ownership = parts.ownership
        fence = ownership.new_fence("deadnode")
        await parts.watch.hold(execution_id, fence)
        claim = await ownership.claim(execution_id, mode, fence, block_id=block_id, answer=answer)
        assert claim.status_before == "paused", claim
    finally:
        await redis.aclose()


@asynccontextmanager
async def lone_replica(valkey: ValkeyServer, root: Path) -> AsyncIterator[tuple[str, str]]:
    """A replica with a 1 s lease on a prefix of its own: (its url, the prefix)."""
    prefix = f"b14{uuid.uuid4().hex[:6]}"
    server = FlowcastServer(
        data_dir=root,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": prefix,
            "FLOWCAST_LEASE_SECONDS": "1",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    try:
        yield server.url, prefix
    finally:
        await server.stop()


async def _types(client: httpx.AsyncClient, execution_id: str) -> list[str]:
    page = (await client.get(f"/api/executions/{execution_id}/events?after=0")).json()
    return [event["type"] for event in page["events"]]


async def _settled(client: httpx.AsyncClient, execution_id: str, seconds: float) -> dict[str, Any]:
    """The snapshot once finished or paused again after a recovery (or after ``seconds``)."""

    async def moved_on() -> dict[str, Any] | None:
        snapshot: dict[str, Any] = (await client.get(f"/api/executions/{execution_id}")).json()
        finished = snapshot["status"] in ("completed", "failed", "cancelled")
        repaused = snapshot["status"] == "paused" and "execution:recovered" in await _types(
            client, execution_id
        )
        return snapshot if finished or repaused else None

    found: dict[str, Any] | None = await within(moved_on, seconds, every=0.05)
    return found or (await client.get(f"/api/executions/{execution_id}")).json()


@pytest.mark.timeout(60)
async def test_a_cancel_accepted_by_a_replica_that_dies_at_once_still_cancels_the_pause(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # SPEC §3: a 202 to a cancel means it will happen, whatever races with it, another
    # replica taking the execution over included. The claim that moved the pause to
    # the canceller cleared cancelRequested, so the replica that recovers it has no
    # record of the cancel and runs the approval again: paused, waiting for a human.
    """Found by the step 14 review."""
    async with lone_replica(valkey, tmp_path) as (url, prefix):
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            workflow_id = f"cx-{unique}"
            await put(client, approval_workflow(workflow_id))
            execution_id = await execute(client, workflow_id, {})
            await wait_status(client, execution_id, "paused")
            await _accepted_then_died(valkey, prefix, execution_id, "cancel")
            snapshot = await _settled(client, execution_id, 20)
            types = await _types(client, execution_id)
    assert snapshot["status"] == "cancelled", (snapshot["status"], types)


@pytest.mark.timeout(60)
async def test_a_resume_accepted_by_a_replica_that_dies_at_once_still_takes_its_answer(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # The same for a resume. The answer lived only in the dead replica's memory until
    # its execution:resumed event was stored, so the replica that recovered the
    # execution ran the approval again and paused, asking the question the 202 had
    # answered. The claim now checkpoints the answer (claim.lua, `a:<block>`).
    """Found by the step 14 review."""
    async with lone_replica(valkey, tmp_path) as (url, prefix):
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            workflow_id = f"rx-{unique}"
            await put(client, approval_workflow(workflow_id))
            execution_id = await execute(client, workflow_id, {})
            await wait_status(client, execution_id, "paused")
            await _accepted_then_died(
                valkey, prefix, execution_id, "resume", "review", b'{"approved": true}'
            )
            snapshot = await _settled(client, execution_id, 20)
            types = await _types(client, execution_id)
            events = (await client.get(f"/api/executions/{execution_id}/events")).json()
    assert snapshot["status"] == "completed", (snapshot["status"], types)
    assert "execution:paused" not in types[types.index("execution:recovered") :], types
    review = [
        e["data"]["output"]
        for e in events["events"]
        if e["type"] == "block:completed" and e["data"]["blockId"] == "review"
    ]
    assert review == [{"approved": True}], review


@pytest.mark.timeout(60)
async def test_a_resume_answered_202_by_a_replica_sigkilled_right_after_takes_effect(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # The same with real processes: A answers the resume 202 and is SIGKILLed while it
    # keeps the answer (a large answer goes to the value store first; A's store fails
    # here, which only stretches the moment between the 202 and the resumed event).
    """Found by the step 14 review."""
    prefix = f"b14{uuid.uuid4().hex[:6]}"
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": prefix,
        "FLOWCAST_LEASE_SECONDS": "1",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        "FLOWCAST_LARGE_VALUE_BYTES": "1024",
    }
    a = FlowcastServer(data_dir=tmp_path / "a", env=env)
    b = FlowcastServer(data_dir=tmp_path / "b", env=env)
    await asyncio.gather(a.start(), b.start())
    try:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
        ):
            workflow_id = f"rk-{unique}"
            await put(on_a, approval_workflow(workflow_id))
            execution_id = await execute(on_a, workflow_id, {})
            await wait_status(on_a, execution_id, "paused")
            # The execution's folder holds its owners' durable records (ceiling.py):
            # replaced by a file, every write into it fails. The paused run writes its
            # final record after the status shows, and may make the folder again between
            # the removal and the file: replaced until a file stands there.
            folder = a.data_dir / "values" / execution_id

            def replaced() -> bool:
                shutil.rmtree(folder, ignore_errors=True)
                try:
                    folder.write_text("not a directory")
                except IsADirectoryError:
                    return False
                return True

            await until(replaced, "the values folder replaced by a file")
            answer = {"note": "x" * 4096}
            resumed = await on_a.post(
                f"/api/executions/{execution_id}/resume", json={"input": answer}
            )
            os.kill(a.pid, signal.SIGKILL)
            assert resumed.status_code == 202, resumed.text
            snapshot = await _settled(on_b, execution_id, 20)
            types = await _types(on_b, execution_id)
    finally:
        await asyncio.gather(a.stop(signal.SIGKILL), b.stop())
    assert snapshot["status"] == "completed", (snapshot["status"], types)
