"""The page shows a queued run as waiting, with its place in line (SPEC §9, §14): its
panel's badge reads ``queued, N ahead`` from the stream's ``queue`` frames, it can be
cancelled, the list shows a queued row, and the run goes on once a slot frees."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from playwright.async_api import Page, expect

from tests.browser.test_page import SETTLE_MS, finished, list_row, start
from tests.browser.test_page import pytestmark as needs_chromium
from tests.support.api import (
    approval_workflow,
    delay_workflow,
    execute,
    put,
    quick_workflow,
    wait_finished,
)
from tests.support.servers import FlowcastServer, ValkeyServer

pytestmark = needs_chromium


@pytest.fixture(scope="module")
async def one_at_a_time(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    """A server of its own that runs one execution of a tenant at a time."""
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page-queue"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"pq{uuid.uuid4().hex[:6]}",
            "FLOWCAST_MAX_RUNNING_PER_TENANT": "1",
        },
    )
    await server.start()
    yield server
    await server.stop()


@pytest.mark.timeout(90)
async def test_a_queued_run_shows_its_place_then_runs_and_its_row_shows_queued(
    one_at_a_time: FlowcastServer, page: Page
) -> None:
    async with httpx.AsyncClient(base_url=one_at_a_time.url, timeout=20) as client:
        await put(client, delay_workflow("slow", ms=3000))
        await put(client, quick_workflow("quick"))
        blocker = await execute(client, "slow")
        await page.goto(one_at_a_time.url)
        execution_id = await start(page, "quick", {})

        badge = page.locator("#run-status")
        await expect(badge).to_have_attribute("data-status", "queued")
        await expect(badge).to_have_text("queued, 0 ahead")
        await expect(page.locator("#cancel")).to_be_visible()
        await expect(list_row(page, execution_id).locator(".status")).to_have_text("queued")
        # The graph is drawn, every block pending, with the place said under it.
        note = page.locator("#graph .graph-note")
        await expect(note).to_have_text("Waiting for a worker: queued, 0 ahead.")
        await expect(page.locator('#graph .graph-node[data-block-id="only"]')).to_have_attribute(
            "data-status", "pending"
        )
        await expect(page.locator("#run-workflow")).to_have_text("workflow quick")

        await finished(page)
        await expect(note).to_be_hidden()
        await expect(page.locator('#graph .graph-node[data-block-id="only"]')).to_have_attribute(
            "data-status", "completed"
        )
        await expect(page.locator("#result-body")).to_contain_text("1")
        await expect(list_row(page, execution_id).locator(".status")).to_have_text(
            "completed", timeout=SETTLE_MS
        )
        assert (await wait_finished(client, blocker))["status"] == "completed"


@pytest.mark.timeout(90)
async def test_a_queued_run_cancelled_from_the_page_never_runs(
    one_at_a_time: FlowcastServer, page: Page
) -> None:
    async with httpx.AsyncClient(base_url=one_at_a_time.url, timeout=20) as client:
        await put(client, delay_workflow("slow", ms=30_000))
        blocker = await execute(client, "slow")
        await page.goto(one_at_a_time.url)
        execution_id = await start(page, "slow", {})
        await expect(page.locator("#run-status")).to_have_text("queued, 0 ahead")
        await page.click("#cancel")
        await finished(page, "cancelled")
        events = (await client.get(f"/api/executions/{execution_id}/events")).json()["events"]
        assert [e["type"] for e in events] == ["execution:started", "execution:cancelled"]
        await client.post(f"/api/executions/{blocker}/cancel")


@pytest.mark.timeout(90)
async def test_an_answer_waiting_in_line_shows_queued_not_a_pause_to_answer_again(
    one_at_a_time: FlowcastServer, page: Page
) -> None:
    async with httpx.AsyncClient(base_url=one_at_a_time.url, timeout=20) as client:
        await put(client, approval_workflow("review"))
        await put(client, delay_workflow("slow", ms=30_000))
        await page.goto(one_at_a_time.url)
        execution_id = await start(page, "review", {})
        await expect(page.locator("#pause")).to_be_visible(timeout=SETTLE_MS)
        blocker = await execute(client, "slow")  # the tenant's one running slot

        await page.click("#pause-submit")
        badge = page.locator("#run-status")
        await expect(badge).to_have_text("queued, 0 ahead")
        await expect(page.locator("#pause")).to_be_hidden()
        # Attached afresh, the replayed pause is not offered again: its answer waits.
        await page.reload()
        await expect(badge).to_have_text("queued, 0 ahead")
        await expect(page.locator("#graph .graph-note")).to_have_text(
            "Waiting for a worker: queued, 0 ahead."
        )
        await expect(page.locator("#pause")).to_be_hidden()

        await client.post(f"/api/executions/{blocker}/cancel")
        await finished(page)
        await expect(page.locator("#graph .graph-note")).to_be_hidden()
        assert (await wait_finished(client, execution_id))["status"] == "completed"
