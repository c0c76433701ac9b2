"""The list pages back in time, finds a run by its id, dates its rows and says it is
loading until it knows (issue 26, page rows; SPEC §9). Before, it showed the newest 20
with times as HH:MM:SS and no date, no search, no paging, and "No executions yet." while
it was still connecting.

In a real Chromium against a server with an API key (a run found by its id or in an
older page is watched with the stream token its snapshot carries); the older runs are
written through the buffer a day back (tests/support/filled.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

import httpx
import pytest
from playwright.async_api import Page, Route, expect
from redis.asyncio import Redis

from app.auth import tenant_of_key
from lib.execution.buffer import EventBuffer
from tests.browser.test_page import (
    API_KEY,
    CHROMIUM,
    DATE_TIME,
    SETTLE_MS,
    finished,
    list_row,
    listed_ids,
    start,
)
from tests.support.api import put, quick_workflow
from tests.support.filled import stored_run
from tests.support.servers import FlowcastServer, ValkeyServer

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (make browser)"),
    pytest.mark.timeout(90),
]

MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
OLDER_RUNS = 45  # the live list's 20, then two pages of 20 and one of 5


@dataclass
class Keyed:
    server: FlowcastServer
    older: list[str]  # runs written a day ago, newest first
    created_ms: dict[str, int]


@pytest.fixture(scope="module")
async def keyed(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[Keyed]:
    space = f"ls{uuid.uuid4().hex[:6]}"
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page-list-search"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": space,
            "FLOWCAST_API_KEYS": API_KEY,
        },
    )
    await server.start()
    redis = Redis.from_url(valkey.url)
    day_ago = int(time.time() * 1000) - 86_400_000
    created: dict[str, int] = {}
    try:
        buffer = EventBuffer(redis=redis, prefix=space)
        for i in range(OLDER_RUNS):
            # Every third one in the same ms as the one before it: pages end among ties.
            ms = day_ago - (i - i % 3 // 2) * 1000
            made = await stored_run(
                buffer, tenant_of_key(API_KEY), "yesterday", status="completed", created_ms=ms
            )
            created[made] = ms
        older = sorted(created, key=lambda made: (-created[made], [-b for b in made.encode()]))
        yield Keyed(server, older, created)
    finally:
        await redis.aclose()
        await server.stop()


@pytest.fixture
async def client(keyed: Keyed) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=keyed.server.url, headers=headers, timeout=20) as made:
        yield made


async def open_with_key(page: Page, keyed: Keyed) -> None:
    await page.goto(keyed.server.url)
    await page.fill("#api-key", API_KEY)
    await page.click("#key-save")
    await expect(page.locator("#list-connection")).to_have_text("live", timeout=SETTLE_MS)


def local_date_time(ms: int) -> str:
    """How the page dates a run created at ``ms``: its local date and time, the year
    only when it is not this year's ("Dec 2 21:35:15")."""
    moment = datetime.fromtimestamp(ms / 1000)
    year = "" if moment.year == datetime.now().year else f" {moment.year}"
    return f"{MONTHS[moment.month - 1]} {moment.day}{year} {moment:%H:%M:%S}"


async def test_load_older_pages_back_to_the_oldest_run_each_once_and_dated(
    keyed: Keyed, page: Page, client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, quick_workflow(f"quick-{unique}"))
    await open_with_key(page, keyed)
    fresh = await start(page, f"quick-{unique}", {})
    await finished(page)
    rows = page.locator("#list-rows tr")
    await expect(rows).to_have_count(20)
    oldest = keyed.older[-1]
    await expect(list_row(page, oldest)).to_have_count(0)  # not on the first page
    while await page.locator("#list-older").is_visible():
        await page.click("#list-older")
        await expect(page.locator("#list-older")).to_have_text("Load older")
    await expect(page.locator("#list-end")).to_have_text("No older executions.")
    shown = await listed_ids(page)
    # Every run once, newest first: ties in one ms neither lost nor repeated.
    assert len(shown) == len(set(shown))
    assert set(keyed.older) <= set(shown) and fresh in shown
    assert [made for made in shown if made in keyed.created_ms] == keyed.older

    # Dated: a day-old run shows its date and time, as does one of a moment ago.
    cell = list_row(page, oldest).locator(".at")
    await expect(cell).to_have_text(local_date_time(keyed.created_ms[oldest]))
    await expect(list_row(page, fresh).locator(".at")).to_have_text(DATE_TIME)

    # An older row attaches like any other, with its snapshot's stream token.
    await list_row(page, oldest).click()
    await expect(page.locator("#run-id")).to_have_text(oldest)
    await finished(page)
    assert "token=" in page.url


async def test_search_by_id_attaches_and_an_unknown_id_says_so(
    keyed: Keyed, page: Page, client: httpx.AsyncClient
) -> None:
    await open_with_key(page, keyed)
    wanted = keyed.older[30]  # on no page shown yet
    await expect(list_row(page, wanted)).to_have_count(0)
    await page.fill("#search-id", f"  {wanted} ")
    await page.press("#search-id", "Enter")
    await expect(page.locator("#run-id")).to_have_text(wanted)
    await finished(page)
    assert page.url.split("#", 1)[1].startswith(f"{wanted}&token=")
    await expect(page.locator("#search-error")).to_be_hidden()

    await page.fill("#search-id", "ex_nosuchexecution0000000000")
    await page.click("#search-go")
    await expect(page.locator("#search-error")).to_contain_text(
        "No execution ex_nosuchexecution0000000000 here"
    )
    await expect(page.locator("#run-id")).to_have_text(wanted)

    # A page link pasted whole finds the id in it.
    linked = keyed.older[40]
    await page.fill("#search-id", f"{keyed.server.url}/#{linked}")
    await page.press("#search-id", "Enter")
    await expect(page.locator("#run-id")).to_have_text(linked)
    await expect(page.locator("#search-error")).to_be_hidden()


async def test_the_list_says_loading_until_its_first_frame(keyed: Keyed, page: Page) -> None:
    held = asyncio.Event()

    async def hold(route: Route) -> None:
        await held.wait()
        await route.continue_()

    await page.route("**/api/executions/live?*", hold)
    await page.goto(keyed.server.url)
    await page.fill("#api-key", API_KEY)
    await page.click("#key-save")
    empty = page.locator("#list-empty")
    await expect(empty).to_have_text("Loading…")
    await expect(page.locator("#list-connection")).to_have_text("connecting…")
    await expect(empty).to_be_visible()
    held.set()
    await expect(page.locator("#list-rows tr")).to_have_count(20, timeout=SETTLE_MS)
    await expect(empty).to_be_hidden()
