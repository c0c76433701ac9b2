"""The CLI tells one duration and every decision as the events do (SPEC §9): a run's
duration from its ``createdAt`` to its terminal event (``run``, ``attach`` of a finished
run, ``list``), how long an approval waited for a person and what they answered
("rejected" with the note), and a block under way when a run is cancelled shown
cancelled, as on the page."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.e2e.cli.test_cli import FLOWCAST, _run_on_a_terminal, cli_env, flowcast, on_a_terminal
from tests.support.api import (
    all_events,
    delay_workflow,
    execute,
    ms_between,
    of_type,
    put,
    refund_workflow,
    until,
    wait_finished,
    wait_status,
)

THINKING_SECONDS = 1.5  # how long the person takes: it must show in every duration
REJECTED = '{"approved": false, "note": "too much"}'


async def figures(client: httpx.AsyncClient, execution_id: str) -> tuple[float, float | None]:
    """From the events' own timestamps: the run's ms (createdAt to its terminal event)
    and how long its pause waited for an answer (None without a pause)."""
    stored = await all_events(client, execution_id)
    snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
    took = ms_between(snapshot["createdAt"], stored[-1]["ts"])
    paused = of_type(stored, "execution:paused")
    if not paused:
        return took, None
    answered = of_type(stored, "execution:resumed") or [stored[-1]]
    return took, ms_between(paused[0]["ts"], answered[0]["ts"])


async def thinking(client: httpx.AsyncClient, execution_id: str) -> bool:
    """The run's delay block (``think``) has started."""
    started = of_type(await all_events(client, execution_id), "block:started")
    return any(event["data"]["blockId"] == "think" for event in started)


@pytest.mark.timeout(60)
async def test_run_says_the_rejection_the_wait_and_the_whole_duration_and_list_agrees(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"cli-refund-{unique}"
    await put(client, refund_workflow(workflow_id))
    url = str(client.base_url)
    process = await asyncio.create_subprocess_exec(
        str(FLOWCAST), "run", workflow_id, "--wait", "--url", url, env=cli_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        async with asyncio.timeout(30):
            execution_id = (await process.stdout.readline()).decode().split()[1]
            while b"execution:paused" not in await process.stdout.readline():
                pass
            await asyncio.sleep(THINKING_SECONDS)  # the person reads: not a readiness wait
            answer = await flowcast("resume", execution_id, "--input", REJECTED, url=url)
            assert answer.code == 0, answer.err
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err
    took, waited = await figures(client, execution_id)
    assert waited is not None and waited >= THINKING_SECONDS * 1000

    lines = out.decode()
    said = re.search(
        r'^\d+ execution:resumed review rejected: "too much" waited=(\d+\.\d\d)s$',
        lines,
        re.MULTILINE,
    )
    assert said, lines
    assert abs(float(said.group(1)) * 1000 - waited) <= 10, (said.group(1), waited)
    ended = re.search(r"^\d+ execution:completed (\d+)ms$", lines, re.MULTILINE)
    assert ended, lines
    assert abs(int(ended.group(1)) - took) <= 2, (ended.group(1), took)

    listed = await flowcast("list", "--workflow", workflow_id, url=url)
    assert listed.code == 0, listed.err
    header, row = listed.out.splitlines()
    assert header.split()[-1] == "DURATION"
    cells = row.split()
    assert cells[0] == execution_id
    assert cells[2] == "completed,rejected"
    shown = re.fullmatch(r"(\d+\.\d)s", cells[-1])
    assert shown, row
    assert abs(float(shown.group(1)) * 1000 - took) <= 60, (row, took)


@on_a_terminal
@pytest.mark.timeout(60)
async def test_attach_on_a_terminal_shows_a_finished_runs_duration_and_its_decision(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"cli-refund-tty-{unique}"
    await put(client, refund_workflow(workflow_id))
    execution_id = await execute(client, workflow_id, {})
    await wait_status(client, execution_id, "paused")
    await asyncio.sleep(THINKING_SECONDS)  # the person reads: not a readiness wait
    url = str(client.base_url)
    answer = await flowcast("resume", execution_id, "--input", REJECTED, url=url)
    assert answer.code == 0, answer.err
    await wait_finished(client, execution_id, timeout=20)
    took, waited = await figures(client, execution_id)
    assert waited is not None

    # Attached after it ended: the figures are the run's, not the time attach took.
    args = [str(FLOWCAST), "attach", execution_id, "--url", url]
    code, screen = await asyncio.wait_for(asyncio.to_thread(_run_on_a_terminal, args, 30), 40)
    shown = "\n".join(screen)
    assert code == 0, shown
    head = next(line for line in screen if line.startswith(execution_id))
    match = re.fullmatch(rf"{execution_id}  {workflow_id}  completed · rejected  (\d+\.\d)s", head)
    assert match, shown
    assert abs(float(match.group(1)) * 1000 - took) <= 60, (head, took)
    review = next(line for line in screen if " review " in line)
    row = re.match(
        r"  ✓ review +approval +completed +waited (\d+\.\d)s +rejected: \"too much\"", review
    )
    assert row, shown
    assert abs(float(row.group(1)) * 1000 - waited) <= 60, (review, waited)


@on_a_terminal
@pytest.mark.timeout(60)
async def test_blocks_under_way_at_a_cancel_read_cancelled_not_running(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    await put(client, delay_workflow(f"cli-stop-{unique}", ms=60_000))
    await put(client, refund_workflow(f"cli-stop-ask-{unique}"))
    running = await execute(client, f"cli-stop-{unique}", {})
    await until(lambda: thinking(client, running), "the delay started", 20)
    paused = await execute(client, f"cli-stop-ask-{unique}", {})
    await wait_status(client, paused, "paused")
    for execution_id in (running, paused):
        assert (await client.post(f"/api/executions/{execution_id}/cancel")).status_code == 202
        await wait_finished(client, execution_id, timeout=20)

    for execution_id, block in ((running, "think"), (paused, "review")):
        took, _ = await figures(client, execution_id)
        args = [str(FLOWCAST), "attach", execution_id, "--url", url]
        code, screen = await asyncio.wait_for(asyncio.to_thread(_run_on_a_terminal, args, 30), 40)
        shown = "\n".join(screen)
        assert code == 3, shown
        head = next(line for line in screen if line.startswith(execution_id))
        match = re.search(r"  cancelled  (\d+\.\d)s$", head)
        assert match, shown
        assert abs(float(match.group(1)) * 1000 - took) <= 60, (head, took)
        row = next(line for line in screen if f" {block} " in line)
        assert re.match(rf"  ⊘ {block} +\w+ +cancelled ", row), shown
        assert "running" not in shown and "paused" not in shown, shown
