"""Faults found in review (SPEC §3, §4, §7): a store rolled back under a pause, a pause
recreated from memory after the store came back empty, and a claim whose reply was lost.

Same shape as test_faults.py: two Flowcast processes (lease 1 s) on one Valkey.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.recovery.test_faults import (
    approval_workflow,
    clients,
    execute,
    follow,
    pair,
    replica,
    same_events,
    settled,
    valkey,
    wait_status,
)
from tests.support.api import all_events, put
from tests.support.faults import FaultyValkey, crash_and_restore, crash_and_wipe, take_snapshot
from tests.support.logcheck import TERMINAL, check_view
from tests.support.servers import FlowcastServer

__all__ = ["pair", "settled", "valkey"]  # fixtures shared with test_faults.py


async def test_a_second_resume_after_a_rollback_never_renames_seen_events(
    pair: tuple[FlowcastServer, FlowcastServer],
    valkey: FaultyValkey,
    unique: str,
    tmp_path: Path,
) -> None:
    # The store forgets a resume (and the run it started) and comes back "paused": a
    # second answer must not give the ids a client already saw to other events.
    async with clients(pair) as (a, b):
        await put(a, approval_workflow(f"rollback-{unique}"))
        execution_id = await execute(a, f"rollback-{unique}")
        await wait_status(a, execution_id, "paused")
        snapshot = await take_snapshot(valkey, tmp_path / "paused.rdb")
        live = asyncio.create_task(follow(a, execution_id))
        await asyncio.sleep(0.2)
        first = await a.post(f"/api/executions/{execution_id}/resume", json={"input": {"ok": True}})
        assert first.status_code == 202, first.text
        await wait_status(a, execution_id, "completed")
        await crash_and_restore(valkey, snapshot)
        second = None
        for _ in range(200):
            with contextlib.suppress(httpx.TransportError):
                second = await b.post(
                    f"/api/executions/{execution_id}/resume", json={"input": {"ok": False}}
                )
                if second.status_code != 503:
                    break
            await asyncio.sleep(0.02)
        assert second is not None
        finished = None
        async with asyncio.timeout(20):
            while finished is None:
                snap = (await b.get(f"/api/executions/{execution_id}")).json()
                if snap["status"] in ("completed", "failed", "cancelled"):
                    finished = snap
                await asyncio.sleep(0.05)
        seen = check_view(await live)
        stored = await all_events(b, execution_id)
    assert seen[-1]["data"]["output"] == {"after": {"ok": True}}, seen[-1]
    same_events(seen, stored)
    assert finished["output"] == seen[-1]["data"]["output"], (second.status_code, finished)


async def test_a_pause_with_a_deadline_is_not_left_paused_after_the_store_came_back_empty(
    pair: tuple[FlowcastServer, FlowcastServer], valkey: FaultyValkey, unique: str
) -> None:
    workflow = approval_workflow(f"wiped-{unique}")
    workflow["blocks"][1]["config"]["timeoutSeconds"] = 2
    async with clients(pair) as (a, b):
        await put(a, workflow)
        execution_id = await execute(a, f"wiped-{unique}")
        await wait_status(a, execution_id, "paused")
        await crash_and_wipe(valkey)
        await put(a, workflow)
        response = await ended_or_after(b, execution_id, seconds=10)
    # Either the execution is gone with the store, or it ended by its deadline: a pause
    # whose deadline nobody watches (and whose run state is gone) waits forever.
    assert response.status_code == 404 or response.json()["status"] != "paused", response.json()


ENDED = ("completed", "failed", "cancelled")


async def ended_or_after(
    client: httpx.AsyncClient, execution_id: str, *, seconds: float
) -> httpx.Response:
    """The execution's snapshot once it is terminal (it stays so), or as it is after
    ``seconds`` (the deadline passed long ago by then; a lease and a sweep too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        response = await client.get(f"/api/executions/{execution_id}")
        ended = response.status_code == 200 and response.json()["status"] in ENDED
        if ended or loop.time() >= deadline:
            return response
        await asyncio.sleep(0.05)


class ReplyDropper:
    """A TCP proxy to Valkey that, once armed, forwards one EVALSHA containing ``word``
    and then closes the client's connection without its reply (a lost reply)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.word: bytes | None = None
        self.fired = 0

    async def _pipe(self, src: Any, dst: Any, inspect: bool, conn: dict[str, Any]) -> None:
        try:
            while data := await src.read(65536):
                if inspect and self.word and b"EVALSHA" in data.upper() and self.word in data:
                    self.word = None
                    self.fired += 1
                    dst.write(data)
                    await dst.drain()
                    conn["drop"] = True
                    await asyncio.sleep(0.2)  # Valkey runs it; its reply goes nowhere
                    conn["client"].close()
                    conn["server"].close()
                    return
                if not inspect and conn.get("drop"):
                    return
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        async def handle(reader: Any, writer: Any) -> None:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.port)
            conn = {"client": writer, "server": server_writer}
            await asyncio.gather(
                self._pipe(reader, server_writer, True, conn),
                self._pipe(server_reader, writer, False, conn),
            )

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()


@pytest.mark.parametrize("operation", ["resume", "cancel"])
async def test_a_claim_whose_reply_was_lost_still_takes_effect(
    valkey: FaultyValkey, tmp_path: Path, unique: str, operation: str
) -> None:
    # Valkey ran the claim, the connection dropped before its reply, redis-py sent the
    # script again on a fresh connection: the answer must be what happened, and the
    # execution must not stay "running" with nobody to run or end it.
    dropper = ReplyDropper(valkey.port)
    async with dropper.serving() as port:
        proxied = replica(valkey, tmp_path, "proxied")
        proxied.env["FLOWCAST_REDIS_URL"] = f"redis://127.0.0.1:{port}"
        direct = replica(valkey, tmp_path, "direct")
        await asyncio.gather(proxied.start(), direct.start())
        try:
            async with clients((proxied, direct)) as (a, b):
                await put(b, approval_workflow(f"lost-{unique}"))
                # Warm the script cache: the armed call must run the script, not NOSCRIPT.
                warm = await execute(b, f"lost-{unique}")
                await wait_status(b, warm, "paused")
                answer = {"input": {"ok": True}}
                assert (await a.post(f"/api/executions/{warm}/resume", json=answer)).is_success
                execution_id = await execute(b, f"lost-{unique}")
                await wait_status(b, execution_id, "paused")
                stream = asyncio.create_task(follow(b, execution_id))
                dropper.word = f"${len(operation)}\r\n{operation}\r\n".encode()
                body = answer if operation == "resume" else None
                response = await a.post(f"/api/executions/{execution_id}/{operation}", json=body)
                assert dropper.fired == 1
                frames = await stream  # every stream ends within about a lease
                stored = await all_events(b, execution_id)
        finally:
            await asyncio.gather(proxied.stop(), direct.stop())
    # It ends (the claim's work done, or a janitor ending what nobody runs), and the
    # answer says what happened: a 202 did it, a 409 did not.
    types = [envelope["type"] for envelope in check_view(frames)]
    assert types and types[-1] in TERMINAL, (response.text, types)
    wanted = "execution:resumed" if operation == "resume" else "execution:cancelled"
    happened = wanted in [envelope["type"] for envelope in stored]
    if response.status_code == 202:
        assert happened, (response.text, stored)
    if response.status_code == 409:
        assert not happened, (response.text, stored)
