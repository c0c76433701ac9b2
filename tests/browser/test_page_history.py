"""A run's history is one click away (issue 26, page rows; SPEC §9): every event with
its time and its payload (collapsed JSON, expanded on a click), every attempt of a
retried block with its error (before, a retry hid attempt 1's error), the run's input
and output, after a reload too, and "Run again with this input", which fills the start
form with the run's workflow and input.

In a real Chromium against a server with the test plugins (``flaky`` fails its first
attempts, retryably). With ``FLOWCAST_UPDATE_SCREENSHOT=1`` the retried run writes the
README's ``docs/history.png``."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from tests.browser.test_page import CHROMIUM, block, finished, screenshot_path, start
from tests.support.api import all_events, put, quick_workflow, streaming_workflow
from tests.support.servers import FlowcastServer, ValkeyServer

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (make browser)"),
    pytest.mark.timeout(90),
]


@pytest.fixture(scope="module")
async def plugged(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page-history"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"ph{uuid.uuid4().hex[:6]}",
            "FLOWCAST_PLUGINS": "tests.support.plugins",
        },
    )
    await server.start()
    yield server
    await server.stop()


def twice_failing_workflow(workflow_id: str) -> dict[str, Any]:
    """One ``flaky`` block that fails attempts 1 and 2 (each with its own message) and
    completes on attempt 3."""
    return {
        "id": workflow_id,
        "blocks": [
            {
                "id": "talk",
                "type": "python",
                "config": {"name": "flaky", "args": {"words": 1, "succeedOn": 3}},
                "retry": {"attempts": 3, "backoffMs": 0},
            }
        ],
        "edges": [],
    }


async def test_a_retried_block_shows_every_failed_attempt_with_its_error(
    plugged: FlowcastServer, page: Page, unique: str, tmp_path: Path
) -> None:
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, twice_failing_workflow(f"flaky-{unique}"))
        await page.goto(plugged.url)
        execution_id = await start(page, f"flaky-{unique}", {"ticket": 4521})
        await finished(page)
        events = await all_events(client, execution_id)
    failures = [e["data"] for e in events if e["type"] == "block:failed"]
    assert [f["attempt"] for f in failures] == [1, 2]
    talk = block(page, "talk")
    await expect(talk.locator(".attempt")).to_have_text("attempt 3")
    tries = talk.locator(".tries li")
    await expect(tries).to_have_count(2)
    for shown, failure in zip(await tries.all(), failures, strict=True):
        attempt, error = failure["attempt"], failure["error"]
        await expect(shown).to_contain_text(f"attempt {attempt} failed")
        # Attempt 1's own message, not only the last attempt's.
        await expect(shown).to_contain_text(f"{error['code']}: {error['message']}")
    assert "attempt 1 with key" in failures[0]["error"]["message"]
    await expect(talk.locator(".error")).to_be_hidden()
    await expect(talk.locator(".chunks")).to_have_text("try3-w0 ")

    # The README's picture: the attempts, the input, and the history with attempt 1's
    # failure opened.
    await page.set_viewport_size({"width": 1360, "height": 1500})
    await page.click("#run-input-box > summary")
    await page.click("#log > summary")
    failed = page.locator('#events > li[data-type="block:failed"]').first
    await failed.locator(".payload summary").click()
    await expect(failed.locator(".payload pre")).to_be_visible()
    await page.locator("#run").screenshot(
        path=str(screenshot_path(tmp_path, "history.png")), animations="disabled"
    )


async def test_the_history_lists_every_event_with_its_time_and_its_payload_on_a_click(
    plugged: FlowcastServer, page: Page, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, streaming_workflow(f"talk-{unique}", words=4))
        await page.goto(plugged.url)
        execution_id = await start(page, f"talk-{unique}", {"name": "Ada"})
        await finished(page)
        events = await all_events(client, execution_id)
    await page.click("#log > summary")
    items = page.locator("#events > li")
    await expect(items).to_have_count(len(events))
    for item, event in zip(await items.all(), events, strict=True):
        assert await item.get_attribute("data-type") == event["type"]
        # Its time, to the ms, in the page's local time; the full timestamp on hover.
        await expect(item.locator(".ts")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d\.\d{3}$"))
        assert await item.locator(".ts").get_attribute("title") == event["ts"]
        payload = item.locator(".payload")
        # Collapsed to one line of JSON until clicked.
        await expect(payload.locator("pre")).to_be_hidden()
        compact = json.dumps(event["data"], separators=(",", ":"), ensure_ascii=False)
        await expect(payload.locator("summary")).to_contain_text(compact[:40])
    completed = items.filter(has=page.locator('.type:text-is("block:completed")')).last
    await completed.locator(".payload summary").click()
    shown = completed.locator(".payload pre")
    await expect(shown).to_be_visible()
    stored = next(e for e in reversed(events) if e["type"] == "block:completed")
    assert json.loads(await shown.inner_text()) == stored["data"]


async def test_input_and_output_show_after_a_reload_and_run_again_fills_the_form(
    plugged: FlowcastServer, page: Page, unique: str
) -> None:
    given = {"name": "Grace", "tags": ["a", "b"]}
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, streaming_workflow(f"talk-{unique}", words=2))
        await put(client, quick_workflow(f"other-{unique}"))
        await page.goto(plugged.url)
        execution_id = await start(page, f"talk-{unique}", given)
        await finished(page)
        await page.reload()
        await expect(page.locator("#run-id")).to_have_text(execution_id)
        await finished(page)

        await page.click("#run-input-box > summary")
        assert json.loads(await page.locator("#run-input").inner_text()) == given
        snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
        await expect(page.locator("#result-title")).to_have_text("Output")
        await expect(page.locator("#result-body")).to_contain_text('"who": "Grace"')
        assert snapshot["output"] == {"done": {"who": "Grace"}}

        # Elsewhere in the form meanwhile: another workflow, another input.
        await page.select_option("#workflow", f"other-{unique}")
        await page.fill("#input", '{"something": "else"}')
        await page.click("#run-again")
        await expect(page.locator("#workflow")).to_have_value(f"talk-{unique}")
        assert json.loads(await page.locator("#input").input_value()) == given
        again = await start_as_filled(page)
        assert again != execution_id
        started = (await all_events(client, again))[0]
        assert started["type"] == "execution:started"
        assert started["data"]["input"] == given


async def start_as_filled(page: Page) -> str:
    """Press Start on the form as it is; the new execution's id."""
    previous = await page.locator("#run-id").inner_text()
    await page.click("#start")
    await expect(page.locator("#run-id")).not_to_have_text(previous)
    return await page.locator("#run-id").inner_text()
