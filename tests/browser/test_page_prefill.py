"""Picking a workflow shows it before it runs (issue 26, page rows; SPEC §9): its graph,
every block pending, and an input box filled from the workflow's ``exampleInput`` (else
``{}``); an input the person typed stays when they pick another workflow. Before, the
box stayed ``{}`` whatever was picked and nothing showed a workflow's blocks until a
run of it.

In a real Chromium against the session's server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, Route, expect

from tests.browser.test_page import CHROMIUM, SETTLE_MS
from tests.support.api import put, quick_workflow
from tests.support.servers import FlowcastServer

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (make browser)"),
    pytest.mark.timeout(60),
]


def fan_workflow(workflow_id: str, **extra: Any) -> dict[str, Any]:
    """start → left, right: three blocks, two edges (one with a condition)."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "start", "type": "transform", "config": {"value": 1}},
            {"id": "left", "type": "transform", "config": {"value": 2}},
            {"id": "right", "type": "transform", "config": {"value": 3}},
        ],
        "edges": [
            {"from": "start", "to": "left"},
            {"from": "start", "to": "right", "when": "input.urgent"},
        ],
        **extra,
    }


async def input_box(page: Page) -> Any:
    return json.loads(await page.locator("#input").input_value())


async def test_picking_a_workflow_draws_its_graph_and_fills_an_empty_input(
    server: FlowcastServer, page: Page, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        await put(client, fan_workflow(f"fan-{unique}"))
        await put(client, quick_workflow(f"quick-{unique}"))
    await page.goto(server.url)
    await page.select_option("#workflow", f"fan-{unique}")
    nodes = page.locator("#preview .graph-node")
    await expect(nodes).to_have_count(3, timeout=SETTLE_MS)
    for status in await nodes.evaluate_all("nodes => nodes.map(node => node.dataset.status)"):
        assert status == "pending"
    await expect(page.locator('#preview .graph-edge[data-to="right"]')).to_have_count(1)
    await expect(page.locator("#preview .graph-when")).to_have_text("input.urgent")
    # No run yet: the run's own graph is not drawn.
    await expect(page.locator("#graph")).to_be_hidden()
    assert await input_box(page) == {}

    # What the person typed stays when they pick another workflow; its graph follows.
    await page.fill("#input", '{"mine": true}')
    await page.select_option("#workflow", f"quick-{unique}")
    await expect(nodes).to_have_count(1)
    await expect(page.locator('#preview .graph-node[data-block-id="only"]')).to_be_visible()
    assert await input_box(page) == {"mine": True}


async def test_a_workflows_example_input_fills_the_input_box(
    server: FlowcastServer, page: Page, unique: str
) -> None:
    example = {"amount": 40, "customer": "Zed"}
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        stored = await client.put(
            f"/api/workflows/ex-{unique}", json=fan_workflow(f"ex-{unique}", exampleInput=example)
        )
        assert stored.status_code in (200, 201), stored.text
        assert (await client.get(f"/api/workflows/ex-{unique}")).json()["exampleInput"] == example
        await put(client, quick_workflow(f"plain-{unique}"))
    await page.goto(server.url)
    await page.select_option("#workflow", f"plain-{unique}")
    await expect(page.locator("#preview .graph-node")).to_have_count(1, timeout=SETTLE_MS)
    # The graph and the input are filled by two reads: the first workflow listed (this
    # example's, when it is the newest) may fill the box a moment before plain's empties it.
    await expect(page.locator("#input")).to_have_value("{}", timeout=SETTLE_MS)
    await page.select_option("#workflow", f"ex-{unique}")
    await expect(page.locator("#input")).not_to_have_value("{}")
    assert await input_box(page) == example
    # Back to one without an example: the panel's own fill goes back to {}.
    await page.select_option("#workflow", f"plain-{unique}")
    await expect(page.locator("#input")).to_have_value("{}")


async def test_the_page_fills_the_input_from_the_documents_example_input(
    server: FlowcastServer, page: Page, unique: str
) -> None:
    """The page's side of the contract alone, whatever this server stores: the workflow
    document read by the page is given an ``exampleInput`` on its way (a fake at the
    seam between the page and the server)."""
    example = {"amount": 40, "items": [1, 2]}
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        await put(client, fan_workflow(f"ex-{unique}"))
        await put(client, quick_workflow(f"plain-{unique}"))

    async def with_example(route: Route) -> None:
        response = await route.fetch()
        document = await response.json()
        await route.fulfill(response=response, json={**document, "exampleInput": example})

    await page.route(f"**/api/workflows/ex-{unique}", with_example)
    await page.goto(server.url)
    await page.select_option("#workflow", f"plain-{unique}")
    await expect(page.locator("#preview .graph-node")).to_have_count(1, timeout=SETTLE_MS)
    await page.select_option("#workflow", f"ex-{unique}")
    await expect(page.locator("#input")).not_to_have_value("{}")
    assert await input_box(page) == example
    await page.select_option("#workflow", f"plain-{unique}")
    await expect(page.locator("#input")).to_have_value("{}")


async def test_a_late_example_never_lands_in_a_box_the_person_is_typing_in(
    server: FlowcastServer, page: Page, unique: str
) -> None:
    """Was a break (a clean-clone CI run): the picked workflow's document arrived while
    the person (Playwright's fill) had selected the box's text to replace it; the page
    wrote its own fill over the selection, and the typed text was added to it: the box
    held "{}{}" and Start refused it as JSON. A box with the focus is the person's."""
    example = {"amount": 40}
    schema = {"type": "object", "properties": {"amount": {"type": "integer"}}}
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        late = fan_workflow(f"late-{unique}", exampleInput=example, inputSchema=schema)
        stored = await client.put(f"/api/workflows/late-{unique}", json=late)
        assert stored.status_code in (200, 201), stored.text
    release = asyncio.Event()

    async def held(route: Route) -> None:
        await release.wait()
        await route.continue_()

    await page.route(f"**/api/workflows/late-{unique}", held)
    await page.goto(server.url)
    box = page.locator("#input")
    await page.select_option("#workflow", f"late-{unique}")
    await box.focus()
    await page.keyboard.press("ControlOrMeta+A")
    release.set()
    # The document has arrived and been read: its schema is shown beside the box.
    await expect(page.locator("#input-hint")).to_be_visible(timeout=SETTLE_MS)
    await page.keyboard.type('{"mine": 1}')
    assert await input_box(page) == {"mine": 1}
