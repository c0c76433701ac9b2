"""``GET /api/executions`` pages back in time (issue 26, page rows; SPEC §3, §9): each
page says ``nextBefore``, the cursor of the page after it, and ``?before=`` with it
reads on from there, so a client reaches every execution the server keeps, newest
first, each once, even those created in the same millisecond as a page's last row;
``before`` also takes a plain creation time in ms. A malformed cursor is 400.

Real processes: a Flowcast server on the session's Valkey; the executions are written
through the buffer as a start writes them (tests/support/filled.py), at creation times
the test picks, so that many share one millisecond.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from app.auth import tenant_of_key
from lib.execution.buffer import EventBuffer
from tests.support.filled import stored_run
from tests.support.servers import ALPHA, BETA, ValkeyServer, authed, prefix, started_server

pytestmark = pytest.mark.timeout(60)

# Creation ms of the stored runs, newest first, and how many share each: pages of 3
# end inside each group of ties.
GROUPS = [(0, 4), (-1_000, 7), (-2_000, 1), (-3_000, 5)]


@dataclass
class Stored:
    client: httpx.AsyncClient
    other: httpx.AsyncClient  # another tenant's
    newest_first: list[str]  # every run, in the list's order
    by_ms: dict[str, int]  # each run's creation ms
    failed: list[str]  # the failed ones, newest first


@pytest.fixture(scope="module")
async def stored(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stored]:
    space = prefix()
    root: Path = tmp_path_factory.mktemp("list-paging")
    server = await started_server(
        root,
        "server",
        FLOWCAST_REDIS_URL=valkey.url,
        FLOWCAST_REDIS_PREFIX=space,
        FLOWCAST_API_KEYS=f"{ALPHA},{BETA}",
    )
    redis = Redis.from_url(valkey.url)
    buffer = EventBuffer(redis=redis, prefix=space)
    now = int(time.time() * 1000)
    by_ms: dict[str, int] = {}
    failed: list[str] = []
    try:
        for offset, count in GROUPS:
            for index in range(count):
                status = "failed" if index % 2 else "completed"
                made = await stored_run(
                    buffer, tenant_of_key(ALPHA), "x", status=status, created_ms=now + offset
                )
                by_ms[made] = now + offset
                if status == "failed":
                    failed.append(made)
        # The list's order: newest first; within one ms, as the index orders its ties.
        order = sorted(by_ms, key=lambda made: (-by_ms[made], [-byte for byte in made.encode()]))
        failed.sort(key=order.index)
        async with authed(server, ALPHA) as client, authed(server, BETA) as other:
            yield Stored(client, other, order, by_ms, failed)
    finally:
        await server.stop()
        await redis.aclose()


async def every_page(client: httpx.AsyncClient, query: str) -> list[list[str]]:
    """The ids of each page of ``GET /api/executions?<query>``, following nextBefore."""
    pages: list[list[str]] = []
    cursor: str | None = None
    while True:
        url = f"/api/executions?{query}" + (f"&before={cursor}" if cursor else "")
        response = await client.get(url)
        assert response.status_code == 200, response.text
        body = response.json()
        pages.append([row["id"] for row in body["executions"]])
        cursor = body["nextBefore"]
        if cursor is None:
            return pages
        assert len(pages) <= 20, "paging never ended"


async def test_pages_of_three_reach_every_execution_once_in_order(stored: Stored) -> None:
    pages = await every_page(stored.client, "limit=3")
    assert [len(page) for page in pages[:-1]] == [3] * (len(pages) - 1)
    assert [made for page in pages for made in page] == stored.newest_first
    # The last full page may be followed by an empty one; never by a repeat.
    assert len(pages) == -(-len(stored.newest_first) // 3) + (len(stored.newest_first) % 3 == 0)


async def test_a_filtered_list_pages_within_its_filter(stored: Stored) -> None:
    pages = await every_page(stored.client, "limit=2&status=failed&workflowId=x")
    assert [made for page in pages for made in page] == stored.failed


async def test_before_a_creation_time_lists_the_executions_created_before_it(
    stored: Stored,
) -> None:
    newest_ms = max(stored.by_ms.values())
    response = await stored.client.get(f"/api/executions?limit=200&before={newest_ms}")
    assert response.status_code == 200, response.text
    body = response.json()
    listed = [row["id"] for row in body["executions"]]
    assert listed == [made for made in stored.newest_first if stored.by_ms[made] < newest_ms]
    assert body["nextBefore"] is None


async def test_the_cursor_of_another_tenants_page_lists_only_the_callers_own(
    stored: Stored,
) -> None:
    first = (await stored.client.get("/api/executions?limit=3")).json()
    response = await stored.other.get(f"/api/executions?before={first['nextBefore']}")
    assert response.status_code == 200, response.text
    assert response.json() == {"executions": [], "nextBefore": None}


@pytest.mark.parametrize(
    "cursor",
    ["yesterday", "-5", "12:", "12:x", "1.5", "12:ex_a b", "9" * 16, ":ex_abc"],
)
async def test_a_malformed_before_is_400_saying_what_it_takes(stored: Stored, cursor: str) -> None:
    response = await stored.client.get("/api/executions", params={"before": cursor})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_parameter"
    assert "before must be" in error["message"]
