"""The CLI shows a queued execution as waiting with its place in line (SPEC §9, §14):
``flowcast run`` and ``attach`` say ``queued, N ahead`` (from the 202, the snapshot and
the stream's ``queue`` frames) until it starts, and ``flowcast list`` shows the place."""

from __future__ import annotations

import asyncio
import io
import re
from pathlib import Path

import pytest

from app.progress import LiveDisplay, PlainDisplay
from tests.e2e.cli.test_cli import FLOWCAST, Result, _event, cli_env
from tests.support.api import (
    approval_workflow,
    delay_workflow,
    put,
    quick_workflow,
    wait_finished,
    wait_status,
)
from tests.support.servers import ValkeyServer, authed, serving


async def started(*args: str, url: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        str(FLOWCAST),
        *args,
        "--url",
        url,
        env=cli_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def ended(process: asyncio.subprocess.Process) -> Result:
    out, err = await process.communicate()
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


async def first_notice(process: asyncio.subprocess.Process) -> str:
    """The first line a following command wrote to stderr."""
    assert process.stderr is not None
    return (await process.stderr.readline()).decode().rstrip("\n")


@pytest.mark.timeout(60)
async def test_run_attach_and_list_show_a_queued_execution_with_its_place(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=30_000))
            await put(client, quick_workflow("quick"))
            blocker = (await client.post("/api/workflows/slow/execute", json={})).json()
            assert blocker["status"] == "running"
            first = (await client.post("/api/workflows/quick/execute", json={})).json()
            assert first["status"] == "queued"

            listed = await ended(await started("list", "--status", "queued", url=server.url))
            assert listed.code == 0, listed.err
            [row] = listed.out.splitlines()[1:]
            assert re.match(rf"{first['executionId']}  quick +queued, 0 ahead  0 ", row), row

            # Each says its place first, while the blocker holds the tenant's one slot.
            attach = await started("attach", first["executionId"], url=server.url)
            assert await first_notice(attach) == "flowcast: queued, 0 ahead"
            run = await started("run", "quick", url=server.url)  # behind the first: 1 ahead
            assert await first_notice(run) == "flowcast: queued, 1 ahead"
            cancel = await client.post(f"/api/executions/{blocker['executionId']}/cancel")
            assert cancel.status_code == 202
            attached, ran = await asyncio.gather(ended(attach), ended(run))

    assert attached.code == 0, attached.err
    assert attached.event_ids[0] == 1 and attached.out.splitlines()[1].startswith(
        "1 execution:started"
    )
    assert ran.code == 0, ran.err
    # Each place is said once, when it changes (the stream's first frame repeats the 202's).
    assert "flowcast: queued, 1 ahead" not in ran.err, ran.err
    assert ran.event_ids == list(range(1, len(ran.event_ids) + 1))
    assert ran.output == {"only": 1}


@pytest.mark.timeout(60)
async def test_a_queued_run_cancelled_exits_3(valkey: ValkeyServer, tmp_path: Path) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, delay_workflow("slow", ms=30_000))
            blocker = (await client.post("/api/workflows/slow/execute", json={})).json()
            run = await started("run", "slow", url=server.url)
            assert run.stdout is not None
            line = (await run.stdout.readline()).decode()
            execution_id = line.split()[1]  # "execution <id> workflow=slow"
            await wait_status(client, execution_id, "queued")
            cancel = await client.post(f"/api/executions/{execution_id}/cancel")
            assert cancel.status_code == 202
            result = await ended(run)
            await client.post(f"/api/executions/{blocker['executionId']}/cancel")
    assert result.code == 3, result.err
    assert "flowcast: queued, 0 ahead" in result.err
    assert [ln.split()[1] for ln in result.out.splitlines()] == [
        "execution:started",
        "execution:cancelled",
    ]


@pytest.mark.timeout(60)
async def test_attach_follows_a_resume_waiting_in_line_instead_of_stopping_at_its_pause(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with serving(valkey, tmp_path, max_running_per_tenant="1") as server:
        async with authed(server) as client:
            await put(client, approval_workflow("review"))
            await put(client, delay_workflow("slow", ms=2000))
            paused = (await client.post("/api/workflows/review/execute", json={})).json()
            eid = paused["executionId"]
            await wait_status(client, eid, "paused")
            blocker = (await client.post("/api/workflows/slow/execute", json={})).json()
            assert blocker["status"] == "running"
            resumed = await client.post(f"/api/executions/{eid}/resume", json={"input": {}})
            assert resumed.status_code == 202 and resumed.json()["status"] == "queued"
            attached = await ended(await started("attach", eid, url=server.url))
            await wait_finished(client, blocker["executionId"])
    assert attached.code == 0, attached.err
    assert "flowcast: queued, 0 ahead" in attached.err
    types = [line.split()[1] for line in attached.out.splitlines() if line[:1].isdigit()]
    assert "execution:resumed" in types and types[-1] == "execution:completed", attached.out


def test_plain_display_says_each_new_place_once_on_stderr() -> None:
    out, err = io.StringIO(), io.StringIO()
    display = PlainDisplay(out, err)
    for ahead in (3, 3, 2, 0):
        display.queued(ahead)
    display.event(_event(1, "execution:started", input=None, queuedMs=5))
    assert out.getvalue() == "1 execution:started\n"
    assert err.getvalue() == (
        "flowcast: queued, 3 ahead\nflowcast: queued, 2 ahead\nflowcast: queued, 0 ahead\n"
    )


def test_live_display_shows_the_place_in_its_header_until_the_run_starts() -> None:
    out = io.StringIO()
    display = LiveDisplay(out, io.StringIO())
    display.started("ex_q", "wf")
    display.queued(12)
    assert re.fullmatch(r"ex_q  wf  queued, 12 ahead  \d+\.\ds", header(display))
    display.queued(4)
    assert "queued, 4 ahead" in header(display)
    display.event(_event(1, "execution:started", input=None, queuedMs=900))
    assert display.status == "running"
    assert re.fullmatch(r"ex_q  wf  running  \d+\.\ds", header(display))
    display.close()


def header(display: LiveDisplay) -> str:
    """The first line of the view as drawn now."""
    with display.console.capture() as captured:
        display.console.print(display.view())
    return captured.get().splitlines()[0].rstrip()
