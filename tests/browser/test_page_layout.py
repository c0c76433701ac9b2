"""The run a person starts or clicks is in view at once (issue 26, page rows; SPEC §9):
the page is a list and a detail, the executions on one side and the run on the other
(stacked on a narrow screen, where the page scrolls to the run), so a long list never
pushes the run away. Before, Start opened the run panel with its top at 917 px in a
900 px high window, and a row click the same.

In a real Chromium against a server of its own, whose list holds older runs written
through the buffer (tests/support/filled.py) besides the runs the page starts."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect
from redis.asyncio import Redis

from app.auth import DEFAULT_TENANT
from lib.execution.buffer import EventBuffer
from tests.browser.test_page import CHROMIUM, SETTLE_MS, finished, list_row, start
from tests.support.api import put, quick_workflow
from tests.support.filled import stored_run
from tests.support.servers import FlowcastServer, ValkeyServer

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (make browser)"),
    pytest.mark.timeout(90),
]

OLDER_RUNS = 45  # more than two pages of the live list's 20
HEIGHT = 900


@dataclass
class Listed:
    server: FlowcastServer
    older: list[str]  # runs written a day ago, newest first


@pytest.fixture(scope="module")
async def listed(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[Listed]:
    """A server of its own (own prefix) with ``OLDER_RUNS`` finished runs of a day ago."""
    space = f"lay{uuid.uuid4().hex[:6]}"
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page-layout"),
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": space},
    )
    await server.start()
    redis = Redis.from_url(valkey.url)
    day_ago = int(time.time() * 1000) - 86_400_000
    try:
        buffer = EventBuffer(redis=redis, prefix=space)
        older = [
            await stored_run(
                buffer, DEFAULT_TENANT, "yesterday", status="completed", created_ms=day_ago - i
            )
            for i in range(OLDER_RUNS)
        ]
        yield Listed(server, older)
    finally:
        await redis.aclose()
        await server.stop()


def chain_workflow(workflow_id: str, blocks: int) -> dict[str, Any]:
    """``blocks`` transforms one after another: a run panel taller than the window."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": f"step-{i:02d}", "type": "transform", "config": {"value": i}}
            for i in range(blocks)
        ],
        "edges": [{"from": f"step-{i:02d}", "to": f"step-{i + 1:02d}"} for i in range(blocks - 1)],
    }


async def box_of(page: Page, selector: str) -> dict[str, float]:
    box = await page.locator(selector).bounding_box()
    assert box is not None, f"{selector} is not shown"
    return box


async def assert_whole_run_in_view(page: Page) -> None:
    """The run panel's box lies inside the viewport, top to bottom."""
    box = await box_of(page, "#run")
    assert box["y"] >= 0 and box["y"] + box["height"] <= HEIGHT, box


async def test_a_started_run_and_a_clicked_row_far_down_are_in_view_at_once(
    listed: Listed, page: Page, unique: str
) -> None:
    await page.set_viewport_size({"width": 1100, "height": HEIGHT})
    async with httpx.AsyncClient(base_url=listed.server.url, timeout=20) as client:
        await put(client, chain_workflow(f"chain-{unique}", 30))
        await put(client, quick_workflow(f"quick-{unique}"))
    await page.goto(listed.server.url)
    await expect(page.locator("#list-rows tr")).to_have_count(20, timeout=SETTLE_MS)
    # A long list: two older pages below the live one.
    for shown in (40, OLDER_RUNS):
        await page.click("#list-older")
        await expect(page.locator("#list-rows tr")).to_have_count(shown)

    await start(page, f"chain-{unique}", {})
    await assert_whole_run_in_view(page)
    await finished(page)
    await expect(page.locator("#timeline li.block")).to_have_count(30)
    # 30 rows of timeline: the panel scrolls within itself, inside the window.
    await assert_whole_run_in_view(page)

    # The oldest row, at the bottom of the list (which scrolls to it for the click).
    oldest = listed.older[-1]
    await list_row(page, oldest).click()
    await expect(page.locator("#run-id")).to_have_text(oldest)
    await assert_whole_run_in_view(page)
    await expect(page.locator("#run-status")).to_have_attribute("data-status", "completed")


async def test_on_a_narrow_screen_the_page_scrolls_to_the_run(
    listed: Listed, page: Page, unique: str
) -> None:
    await page.set_viewport_size({"width": 760, "height": HEIGHT})
    async with httpx.AsyncClient(base_url=listed.server.url, timeout=20) as client:
        await put(client, quick_workflow(f"quick-{unique}"))
    await page.goto(listed.server.url)
    await expect(page.locator("#list-rows tr")).to_have_count(20, timeout=SETTLE_MS)
    # Stacked: the run panel comes below the list, out of the window until revealed.
    assert (await box_of(page, "#executions"))["y"] + 200 < (await box_of(page, "#detail"))["y"]

    await start(page, f"quick-{unique}", {})
    box = await box_of(page, "#run")
    assert 0 <= box["y"] < HEIGHT / 4, box
    await finished(page)

    await page.evaluate("window.scrollTo(0, 0)")
    last = page.locator("#list-rows tr").last
    far_down = await last.get_attribute("data-execution-id")
    assert far_down in listed.older
    await last.click()
    await expect(page.locator("#run-id")).to_have_text(far_down)
    box = await box_of(page, "#run")
    assert 0 <= box["y"] < HEIGHT / 4, box
