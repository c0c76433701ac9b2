"""The page tells the truth about a run (SPEC §9), in a real Chromium: one duration
(from ``createdAt`` to the terminal event) in the run panel and the list, measured
against the events' own timestamps; an approval's wait for a person and its answer; a
rejection that reads as one (badge, outcome, timeline, graph, list); and blocks under way
at a cancel shown cancelled in the timeline as in the graph.

With ``FLOWCAST_UPDATE_SCREENSHOT=1`` the rejection writes the README's
``docs/rejected.png``."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from tests.browser.test_page import (
    CHROMIUM,
    SETTLE_MS,
    block,
    finished,
    list_row,
    node,
    screenshot_path,
    start,
)
from tests.support.api import (
    all_events,
    delay_workflow,
    ms_between,
    of_type,
    put,
    refund_workflow,
    until,
)
from tests.support.servers import FlowcastServer, ValkeyServer

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (make browser)"),
    pytest.mark.timeout(90),
]

THINKING_SECONDS = 1.5  # how long the person takes: it must show in every duration
# A duration shown to the tenth of a second, against the events' ms: rounding, plus the
# few ms between createdAt and the first event of a run that started at once.
TENTH = 60


@pytest.fixture(scope="module")
async def truthful(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    """A server of its own (own prefix): its list holds only these runs."""
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page-truth"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"pt{uuid.uuid4().hex[:6]}",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    yield server
    await server.stop()


DURATION = r"(\d+(?:\.\d)? m?s)"  # as the page writes one: "850 ms", "7.6 s"


def ms_in(text: str, pattern: str) -> float:
    """The ms of the duration (``DURATION``) that ``pattern`` finds in ``text``."""
    found = re.search(pattern.replace("{D}", DURATION), text)
    assert found, (pattern, text)
    number, unit = found.group(1).split(" ")
    return float(number) * (1 if unit == "ms" else 1000)


async def took(client: httpx.AsyncClient, execution_id: str) -> tuple[float, list[Any]]:
    """The run's ms from its createdAt to its terminal event, and its events."""
    stored = await all_events(client, execution_id)
    snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
    return ms_between(snapshot["createdAt"], stored[-1]["ts"]), stored


async def same_duration_in_the_list(page: Page, execution_id: str) -> None:
    """The list row says the run panel's duration, word for word."""
    cell = list_row(page, execution_id).locator(".duration")

    async def agree() -> bool:
        panel = await page.locator("#run-duration").inner_text()
        shown = re.search(DURATION + "$", panel)
        return bool(shown) and shown.group(1) == await cell.inner_text()

    await until(agree, "the panel's duration in the list row", timeout=SETTLE_MS / 1000)


async def test_a_rejection_reads_as_one_with_the_wait_and_the_whole_duration(
    truthful: FlowcastServer, page: Page, unique: str, tmp_path: Path
) -> None:
    workflow_id = f"refund-{unique}"
    async with httpx.AsyncClient(base_url=truthful.url, timeout=20) as client:
        await put(client, refund_workflow(workflow_id))
        await page.goto(truthful.url)
        execution_id = await start(page, workflow_id, {})
        await expect(page.locator("#pause")).to_be_visible(timeout=SETTLE_MS)
        await expect(block(page, "review").locator(".duration")).to_have_text(
            "waiting for a person"
        )
        await asyncio.sleep(THINKING_SECONDS)  # the person reads: not a readiness wait
        await page.fill("#field-note", "too much")
        await page.click("#pause-reject")
        await finished(page)

        ms, stored = await took(client, execution_id)
        (paused,) = of_type(stored, "execution:paused")
        (resumed,) = of_type(stored, "execution:resumed")
        assert resumed["data"]["input"] == {"approved": False, "note": "too much"}
        waited = ms_between(paused["ts"], resumed["ts"])
        assert waited >= THINKING_SECONDS * 1000

    # The outcome: not a plain green "completed".
    badge = page.locator("#run-status")
    await expect(badge).to_have_text("completed · rejected")
    await expect(badge).to_have_attribute("data-decision", "rejected")
    await expect(page.locator("#result-title")).to_have_text("Rejected")
    await expect(page.locator("#result-body")).to_contain_text("Rejected at review: “too much”.")
    # The timeline: who waited how long, and what was answered.
    review = block(page, "review")
    await expect(review.locator(".decision")).to_have_text("rejected: “too much”")
    await expect(review.locator(".decision")).to_have_attribute("data-decision", "rejected")
    wait_text = await review.locator(".duration").inner_text()
    shown_wait = ms_in(wait_text, r"^waited {D} for a person$")
    assert abs(shown_wait - waited) <= TENTH, (wait_text, waited)
    await expect(block(page, "issue").locator(".status")).to_have_text("skipped")
    # The graph and the list say it too.
    await expect(node(page, "review").locator(".graph-state")).to_have_text("rejected · approval")
    await expect(node(page, "review")).to_have_attribute("data-decision", "rejected")
    await expect(list_row(page, execution_id).locator(".status")).to_have_text(
        "completed · rejected", timeout=SETTLE_MS
    )
    # One duration: the pause included, as the events' own clock tells it.
    panel = await page.locator("#run-duration").inner_text()
    assert abs(ms_in(panel, r"^· finished in {D}$") - ms) <= TENTH, (panel, ms)
    await same_duration_in_the_list(page, execution_id)
    # The README's picture of a rejection: the run panel, graph to outcome, as wide as
    # on a desktop screen.
    await page.set_viewport_size({"width": 1360, "height": 1000})
    await page.locator("#run").screenshot(
        path=str(screenshot_path(tmp_path, "rejected.png")), animations="disabled"
    )


async def test_blocks_under_way_at_a_cancel_read_cancelled_in_every_view(
    truthful: FlowcastServer, page: Page, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=truthful.url, timeout=20) as client:
        await put(client, delay_workflow(f"long-{unique}", ms=60_000))
        await put(client, refund_workflow(f"ask-{unique}"))
        await page.goto(truthful.url)

        running = await start(page, f"long-{unique}", {})
        await expect(block(page, "think").locator(".status")).to_have_text(
            "started", timeout=SETTLE_MS
        )
        await page.click("#cancel")
        await finished(page, "cancelled")
        ms, _ = await took(client, running)
        for view in (block(page, "think"), node(page, "think")):
            await expect(view).to_have_attribute("data-status", "cancelled")
        await expect(block(page, "think").locator(".status")).to_have_text("cancelled")
        await expect(block(page, "hello").locator(".status")).to_have_text("completed")
        panel = await page.locator("#run-duration").inner_text()
        assert abs(ms_in(panel, r"^· cancelled after {D}$") - ms) <= TENTH, (panel, ms)
        await expect(list_row(page, running).locator(".status")).to_have_text(
            "cancelled", timeout=SETTLE_MS
        )
        await same_duration_in_the_list(page, running)

        # A pause cancelled: the approval waited, and nobody answered.
        paused = await start(page, f"ask-{unique}", {})
        await expect(page.locator("#pause")).to_be_visible(timeout=SETTLE_MS)
        await page.click("#cancel")
        await finished(page, "cancelled")
        _, stored = await took(client, paused)
        waited = ms_between(of_type(stored, "execution:paused")[0]["ts"], stored[-1]["ts"])
        for view in (block(page, "review"), node(page, "review")):
            await expect(view).to_have_attribute("data-status", "cancelled")
        text = await block(page, "review").locator(".duration").inner_text()
        assert abs(ms_in(text, r"^waited {D}, no answer$") - waited) <= TENTH, (text, waited)
        await expect(page.locator("#pause")).to_be_hidden()
