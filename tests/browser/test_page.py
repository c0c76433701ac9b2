"""The web page in a real browser: Debian's Chromium driven by Playwright, against real
Flowcast servers on 127.0.0.1. The page starts runs, watches them over EventSource,
re-attaches after a reload, answers pauses with a form built from the schema, cancels,
opens large values, and draws the workflow as a graph whose nodes follow the run.

Set ``FLOWCAST_UPDATE_SCREENSHOT=1`` to write the README's ``docs/screenshot.png`` and
``docs/graph.png`` and ``docs/executions.png`` (the list of recent executions).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, Request, Route, expect

from tests.support.api import (
    all_events,
    execute,
    flaky_workflow,
    put,
    quick_workflow,
    streaming_workflow,
    wait_finished,
)
from tests.support.llm import FakeLLM, Reply
from tests.support.servers import ROOT, FlowcastServer, ValkeyServer

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no /usr/bin/chromium (Debian's chromium); `make test` installs it when run as root",
)

SETTLE_MS = 30_000  # how long expect() waits for a run to reach a state
# As the page dates a run: "Dec 2 21:35:15", "Dec 31 2025 23:59:01" (not this year's).
DATE_TIME = re.compile(r"^[A-Z][a-z]{2} \d{1,2}( \d{4})? \d\d:\d\d:\d\d$")
API_KEY = "page-key-" + "p" * 24
LLM_KEY = "sk-page-model-key"


@pytest.fixture(scope="module")
async def guarded(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    """A server with an API key, a small offload threshold, a short ring, and SSE
    connections it closes after a second and a half."""
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"page{uuid.uuid4().hex[:6]}",
            "FLOWCAST_API_KEYS": API_KEY,
            "FLOWCAST_LARGE_VALUE_BYTES": "1024",
            "FLOWCAST_EVENT_LIMIT": "60",
            "FLOWCAST_SSE_MAX_SECONDS": "1.5",
        },
    )
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    """A fake OpenAI-compatible model on 127.0.0.1, the ``plugged`` server's provider."""
    with FakeLLM(api_key=LLM_KEY) as fake:
        yield fake


@pytest.fixture(scope="module")
async def plugged(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer, llm: FakeLLM
) -> AsyncIterator[FlowcastServer]:
    """A server with the test plugins, among them ``flaky`` (streams, then fails once),
    and the fake model as its default ``llm`` provider."""
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page-plugged"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"page{uuid.uuid4().hex[:6]}",
            "FLOWCAST_PLUGINS": "tests.support.plugins",
            "FLOWCAST_LLM_PROVIDERS": json.dumps(
                {"default": {"baseUrl": llm.url, "apiKey": LLM_KEY}}
            ),
        },
    )
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def keyed_client(guarded: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=20) as client:
        yield client


# ---------------------------------------------------------------- helpers


async def start(page: Page, workflow_id: str, input: Any) -> str:
    """Pick a workflow, type its input, press Start; returns the new execution's id."""
    run_id = page.locator("#run-id")
    previous = await run_id.text_content() or ""
    await page.select_option("#workflow", workflow_id)
    await page.fill("#input", json.dumps(input))
    await page.click("#start")
    await expect(run_id).to_have_text(re.compile(r"^ex_"))
    if previous:
        await expect(run_id).not_to_have_text(previous)
    execution_id = await run_id.inner_text()
    assert page.url.split("#", 1)[1].split("&", 1)[0] == execution_id
    return execution_id


async def use_key(page: Page) -> None:
    await expect(page.locator("#launch-error")).to_contain_text("needs an API key")
    await page.fill("#api-key", API_KEY)
    await page.click("#key-save")
    await expect(page.locator("#launch-error")).to_be_hidden()


async def finished(page: Page, status: str = "completed") -> None:
    await expect(page.locator("#run-status")).to_have_attribute(
        "data-status", status, timeout=SETTLE_MS
    )


async def event_ids(page: Page) -> list[int]:
    ids: list[int] = await page.locator("#events li").evaluate_all(
        "items => items.map(item => Number(item.dataset.eventId))"
    )
    return ids


async def block_ids(page: Page) -> list[str]:
    ids: list[str] = await page.locator("#timeline li.block").evaluate_all(
        "rows => rows.map(row => row.dataset.blockId)"
    )
    return ids


def block(page: Page, block_id: str) -> Any:
    return page.locator(f'#timeline li.block[data-block-id="{block_id}"]')


def screenshot_path(tmp_path: Path, name: str = "screenshot.png") -> Path:
    if os.environ.get("FLOWCAST_UPDATE_SCREENSHOT") == "1":
        target = ROOT / "docs" / name
        target.parent.mkdir(exist_ok=True)
        return target
    return tmp_path / name


# ---------------------------------------------------------------- the server's own page


async def test_page_is_served_with_its_assets(client: httpx.AsyncClient) -> None:
    page = await client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    # Every script module and stylesheet in app/static: a module the server does not
    # serve would break the page's imports.
    kinds = {".js": "text/javascript", ".css": "text/css"}
    assets = sorted(p for p in (ROOT / "app" / "static").iterdir() if p.suffix in kinds)
    assert {"page.js", "list.js", "graph.js", "graph-layout.js", "page.css"} <= {
        p.name for p in assets
    }
    for path in assets:
        response = await client.get(f"/static/{path.name}")
        assert response.status_code == 200, path.name
        assert response.headers["content-type"].startswith(kinds[path.suffix])
    assert (await client.get("/static/secrets.py")).status_code == 404


async def test_page_starts_a_workflow_and_shows_its_timeline(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    await page.goto(server.url)
    execution_id = await start(page, "parallel-report", {"topic": "the web page"})
    await finished(page)

    assert sorted(await block_ids(page)) == ["outline", "report", "sales", "support", "usage"]
    for row in await page.locator("#timeline li.block").all():
        await expect(row.locator(".status")).to_have_text("completed")
        await expect(row.locator(".duration")).to_have_text(re.compile(r"\d"))
    await expect(block(page, "usage").locator(".chunks")).to_have_text(
        "Usage grew in every region this week."
    )
    await expect(page.locator("#result-body")).to_contain_text("Report on the web page")
    await expect(page.locator("#cancel")).to_be_hidden()

    snapshot = await wait_finished(client, execution_id)
    assert await event_ids(page) == list(range(1, snapshot["lastEventId"] + 1))
    # Tall enough for the whole run beside the list (the run scrolls within itself).
    await page.set_viewport_size({"width": 1360, "height": 1560})
    await page.screenshot(path=str(screenshot_path(tmp_path)), animations="disabled")


async def test_reload_mid_run_reattaches_and_shows_every_event_once(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient
) -> None:
    await page.goto(server.url)
    execution_id = await start(
        page, "stream-story", {"hero": "a browser tab", "tokensPerSecond": 8}
    )
    story = block(page, "story").locator(".chunks")
    await expect(story).to_contain_text("Once upon a time")
    assert (await client.get(f"/api/executions/{execution_id}")).json()["status"] == "running"
    before = page.url

    await page.reload()

    assert page.url == before
    await expect(page.locator("#run-id")).to_have_text(execution_id)
    await finished(page)
    snapshot = await wait_finished(client, execution_id)
    text = snapshot["output"]["result"]["story"]
    assert text.startswith("Once upon a time a browser tab streamed")
    await expect(story).to_have_text(text)
    assert await block_ids(page) == ["story", "result"]
    assert await event_ids(page) == list(range(1, snapshot["lastEventId"] + 1))
    assert await page.locator("#run").get_attribute("data-duplicates") == "0"
    chunks = page.locator('#events li[data-type="block:chunk"]')
    await expect(chunks).to_have_count(len(text.split()))
    await expect(page.locator("#notices .notice")).to_have_count(0)


async def test_approval_form_approves_and_runs_the_approved_branch(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient
) -> None:
    await page.goto(server.url)
    execution_id = await start(page, "approve-refund", {"amount": 40, "customer": "Globex"})
    form = page.locator("#pause")
    await expect(form).to_be_visible()
    await expect(page.locator("#run-status")).to_have_text("paused")
    await expect(page.locator("#pause-prompt")).to_have_text("Refund 40 to Globex?")
    # `approved` is answered by the two buttons; `note` is a text field, not required.
    await expect(page.locator("#field-approved")).to_have_count(0)
    await expect(page.locator("#field-note")).to_have_attribute("type", "text")
    await expect(page.locator("#pause-submit")).to_have_text("Approve")
    await expect(page.locator("#pause-reject")).to_be_visible()
    await expect(page.locator("#pause-fields")).to_have_text("note")

    await page.fill("#field-note", "fine by me")
    await page.click("#pause-submit")

    await finished(page)
    await expect(form).to_be_hidden()
    await expect(block(page, "issue").locator(".status")).to_have_text("completed")
    await expect(page.locator("#result-body")).to_contain_text("fine by me")
    events = await all_events(client, execution_id)
    resumed = [e["data"] for e in events if e["type"] == "execution:resumed"]
    assert resumed == [{"blockId": "review", "input": {"approved": True, "note": "fine by me"}}]
    assert (await wait_finished(client, execution_id))["output"] == {
        "issue": {"refunded": 40, "note": "fine by me"}
    }


async def test_reject_answers_approved_false_and_skips_the_branch(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient
) -> None:
    await page.goto(server.url)
    execution_id = await start(page, "approve-refund", {})
    await expect(page.locator("#pause")).to_be_visible()
    await page.click("#pause-reject")
    await finished(page)
    await expect(block(page, "issue").locator(".status")).to_have_text("skipped")
    events = await all_events(client, execution_id)
    resumed = [e["data"]["input"] for e in events if e["type"] == "execution:resumed"]
    assert resumed == [{"approved": False}]


async def test_pause_form_is_built_from_the_schema(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient, unique: str
) -> None:
    typed = {
        "type": "object",
        "required": ["name", "count"],
        "properties": {
            "name": {"type": "string"},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "urgent": {"type": "boolean"},
            "tier": {"enum": ["gold", "silver"]},
        },
    }
    nested = {"type": "object", "properties": {"items": {"type": "array"}}}
    for suffix, schema in (("typed", typed), ("nested", nested)):
        await put(
            client,
            {
                "id": f"ask-{suffix}-{unique}",
                "blocks": [
                    {"id": "ask", "type": "approval", "config": {"prompt": "?", "schema": schema}},
                    {
                        "id": "echo",
                        "type": "transform",
                        "config": {"value": "{{ blocks.ask.output }}"},
                    },
                ],
                "edges": [{"from": "ask", "to": "echo"}],
            },
        )
    await page.goto(server.url)

    first = await start(page, f"ask-typed-{unique}", {})
    await expect(page.locator("#pause")).to_be_visible()
    await expect(page.locator("#field-name")).to_have_attribute("type", "text")
    await expect(page.locator("#field-count")).to_have_attribute("type", "number")
    await expect(page.locator("#field-ratio")).to_have_attribute("type", "number")
    await expect(page.locator("#field-urgent")).to_have_attribute("type", "checkbox")
    await expect(page.locator("select#field-tier option")).to_have_text(["—", "gold", "silver"])
    required = page.locator("#pause-fields .field:has(.required)")
    assert await required.evaluate_all("f => f.map(x => x.dataset.field)") == ["name", "count"]
    await expect(page.locator("#pause-submit")).to_have_text("Submit")
    await expect(page.locator("#pause-reject")).to_be_hidden()

    await page.fill("#field-name", "Ada")
    await page.fill("#field-count", "3")
    await page.fill("#field-ratio", "0.5")
    await page.check("#field-urgent")
    await page.select_option("#field-tier", label="silver")
    await page.click("#pause-submit")
    await finished(page)
    answer = {"name": "Ada", "count": 3, "ratio": 0.5, "urgent": True, "tier": "silver"}
    assert (await wait_finished(client, first))["output"] == {"echo": answer}

    second = await start(page, f"ask-nested-{unique}", {})
    await expect(page.locator("#field-json")).to_be_visible()
    await page.fill("#field-json", '{"items": [1, 2]}')
    await page.click("#pause-submit")
    await finished(page)
    assert (await wait_finished(client, second))["output"] == {"echo": {"items": [1, 2]}}


async def test_cancel_button_cancels_the_run(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient
) -> None:
    await page.goto(server.url)
    execution_id = await start(page, "stream-story", {"tokensPerSecond": 4})
    await expect(block(page, "story").locator(".chunks")).to_contain_text("Once")
    await page.click("#cancel")
    await finished(page, "cancelled")
    await expect(page.locator("#result-title")).to_have_text("Cancelled")
    await expect(page.locator("#cancel")).to_be_hidden()
    assert (await wait_finished(client, execution_id))["status"] == "cancelled"


# ---------------------------------------------------------------- with an API key


async def test_large_value_shows_its_preview_and_opens_in_full(
    guarded: FlowcastServer, page: Page, keyed_client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"big-{unique}"
    await put(
        keyed_client,
        {
            "id": workflow_id,
            "blocks": [{"id": "big", "type": "payload", "config": {"bytes": 6000}}],
            "edges": [],
        },
    )
    await page.goto(guarded.url)
    await use_key(page)
    execution_id = await start(page, workflow_id, {})
    assert "&token=" in page.url
    await finished(page)

    ref = block(page, "big").locator(".ref")
    await expect(ref.locator(".badge")).to_have_text("large string")
    await expect(ref.locator(".preview")).to_contain_text('"')
    await ref.locator(".open-value").click()
    shown = ref.locator(".full-value")
    await expect(shown).to_be_visible()

    events = await all_events(keyed_client, execution_id)
    (output,) = [e["data"]["output"] for e in events if e["type"] == "block:completed"]
    assert output["$ref"] == "value"
    assert await ref.get_attribute("data-value-id") == output["id"]
    value = (await keyed_client.get(f"/api/executions/{execution_id}/values/{output['id']}")).json()
    assert len(value) == 5998
    assert json.loads(await shown.text_content() or "null") == value


async def test_gap_notice_when_events_were_evicted(
    guarded: FlowcastServer, page: Page, keyed_client: httpx.AsyncClient, unique: str
) -> None:
    # 120 words make more events than the server's ring of 60 keeps.
    await put(keyed_client, streaming_workflow(f"long-{unique}", words=120))
    started = await keyed_client.post(
        f"/api/workflows/long-{unique}/execute", json={"input": {"name": "gap"}}
    )
    assert started.status_code == 202, started.text
    execution_id, token = started.json()["executionId"], started.json()["streamToken"]
    snapshot = await wait_finished(keyed_client, execution_id)
    first_kept = snapshot["firstRetainedEventId"]
    assert first_kept > 1

    await page.goto(guarded.url)
    await use_key(page)
    await page.goto(f"{guarded.url}/#{execution_id}&token={token}")
    await finished(page)
    await expect(page.locator("#notices .notice")).to_have_text(
        f"{first_kept - 1} events were not retained (evicted): events 1 to {first_kept - 1} "
        f"cannot be shown; what follows starts at event {first_kept}."
    )
    assert await event_ids(page) == list(range(first_kept, snapshot["lastEventId"] + 1))


async def test_eventsource_reconnects_with_last_event_id_and_misses_nothing(
    guarded: FlowcastServer, page: Page, keyed_client: httpx.AsyncClient
) -> None:
    streams: list[Request] = []
    page.on(
        "request",
        lambda request: (
            streams.append(request) if request.url.split("?")[0].endswith("/stream") else None
        ),
    )
    await page.goto(guarded.url)
    await use_key(page)
    # About four seconds of words: the server closes each connection after 1.5 s.
    execution_id = await start(page, "stream-story", {"tokensPerSecond": 7})
    await finished(page)

    snapshot = await wait_finished(keyed_client, execution_id)
    await expect(block(page, "story").locator(".chunks")).to_have_text(
        snapshot["output"]["result"]["story"]
    )
    assert await event_ids(page) == list(range(1, snapshot["lastEventId"] + 1))
    assert await page.locator("#run").get_attribute("data-duplicates") == "0"
    sent = [await request.all_headers() for request in streams]
    assert len(sent) >= 2, sent
    assert "last-event-id" not in sent[0]
    cursors = [int(headers["last-event-id"]) for headers in sent[1:]]
    assert cursors == sorted(cursors) and cursors[0] > 0, cursors


# ---------------------------------------------------------------- blocks that run again


async def test_a_retried_block_shows_only_its_latest_attempts_text(
    plugged: FlowcastServer, page: Page, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, flaky_workflow(f"flaky-{unique}"))
        await page.goto(plugged.url)
        execution_id = await start(page, f"flaky-{unique}", {})
        await finished(page)
        events = await all_events(client, execution_id)
    talk = block(page, "talk")
    await expect(talk.locator(".chunks")).to_have_text("try2-w0 try2-w1 try2-w2 ")
    await expect(talk.locator(".attempt")).to_have_text("attempt 2")
    await expect(talk.locator(".error")).to_be_hidden()
    # The failed attempt's chunks are still in the log; only the block's text restarts.
    assert [e["data"]["text"] for e in events if e["type"] == "block:chunk"] == [
        "try1-w0 ",
        "try1-w1 ",
        "try1-w2 ",
        "try2-w0 ",
        "try2-w1 ",
        "try2-w2 ",
    ]
    await expect(page.locator('#events li[data-type="block:chunk"]')).to_have_count(6)


def sse_body(events: list[tuple[str, dict[str, Any]]], first_id: int) -> str:
    """Stream frames for ``(type, data)`` pairs numbered from ``first_id``."""
    frames = ["retry: 100\n\n"]
    for offset, (kind, data) in enumerate(events):
        event_id = first_id + offset
        envelope = {
            "id": event_id,
            "type": kind,
            "executionId": "ex_recovered",
            "workflowId": "parallel-report",
            "ts": f"2026-12-01T10:00:{event_id:02d}.000Z",
            "data": data,
        }
        frames.append(f"id: {event_id}\nevent: {kind}\ndata: {json.dumps(envelope)}\n\n")
    return "".join(frames)


async def test_a_recovery_keeps_the_run_going_and_restarts_the_rerun_blocks_text(
    server: FlowcastServer, page: Page
) -> None:
    # No server can be made to recover on cue here, so the page's stream is answered
    # in the browser: the events as SPEC §4 and §7 describe a recovery, in two
    # connections, the second held until the page has shown the first.
    before = [
        ("execution:started", {"input": None}),
        ("block:started", {"blockId": "kept", "blockType": "transform", "attempt": 1}),
        ("block:completed", {"blockId": "kept", "output": 1, "durationMs": 2}),
        ("block:started", {"blockId": "talk", "blockType": "generate", "attempt": 1}),
        ("block:chunk", {"blockId": "talk", "text": "lost words "}),
        (
            "execution:recovered",
            {"reason": "worker_lost", "recovery": 1, "rerun": ["talk"], "completed": ["kept"]},
        ),
        ("block:started", {"blockId": "talk", "blockType": "generate", "attempt": 2}),
        ("block:chunk", {"blockId": "talk", "text": "fresh "}),
    ]
    after = [
        ("block:chunk", {"blockId": "talk", "text": "words"}),
        ("block:completed", {"blockId": "talk", "output": "fresh words", "durationMs": 5}),
        ("execution:completed", {"output": {"talk": "fresh words"}, "durationMs": 9}),
    ]
    release = asyncio.Event()
    connections: list[str] = []

    async def stream(route: Route) -> None:
        connections.append(route.request.url)
        if len(connections) == 1:
            body = sse_body(before, 1)
        else:
            await release.wait()
            body = sse_body(after, len(before) + 1)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        await route.fulfill(status=200, headers=headers, body=body)

    await page.route(re.compile(r"/api/executions/ex_recovered/stream"), stream)
    try:
        await page.goto(f"{server.url}/#ex_recovered")
        talk = block(page, "talk")
        await expect(talk.locator(".chunks")).to_have_text("fresh ")
        await expect(page.locator("#run-status")).to_have_attribute("data-status", "running")
        await expect(page.locator("#notices .notice.info")).to_have_text(
            "Recovered (worker_lost): 1 block re-run, 1 kept from the checkpoint."
        )
        await expect(talk.locator(".attempt")).to_have_text("attempt 2")
        await expect(talk.locator(".status")).to_have_text("running")
        await expect(block(page, "kept").locator(".status")).to_have_text("completed")
        recovered = page.locator('#events li[data-type="execution:recovered"]')
        await expect(recovered.locator(".detail")).to_have_text("worker_lost")
    finally:
        release.set()
    await finished(page)
    await expect(block(page, "talk").locator(".chunks")).to_have_text("fresh words")
    # The run's one duration is its creation (event 1, one second per event here) to its
    # end, the recovery included: not a figure counted from the recovery (SPEC §9).
    await expect(page.locator("#run-duration")).to_have_text("· finished in 10.0 s")
    await expect(page.locator("#cancel")).to_be_hidden()
    assert await event_ids(page) == list(range(1, len(before) + len(after) + 1))
    assert len(connections) == 2, "the page reconnected once and finished"


# ---------------------------------------------------------------- the workflow graph

# Every status each graph node shows, in order, whatever the polling misses: a mutation
# record's old value is the status before it, the node's current one the last.
STATUS_RECORDER = """(() => {
  window.graphHistory = {};
  const push = (id, status) => {
    const seen = (window.graphHistory[id] ||= []);
    if (seen[seen.length - 1] !== status) seen.push(status);
  };
  new MutationObserver((records) => {
    const touched = new Set();
    for (const record of records) {
      if (record.type === "attributes" && record.target.matches("#graph .graph-node")) {
        push(record.target.dataset.blockId, record.oldValue);
        touched.add(record.target);
      }
      for (const added of record.addedNodes) {
        if (added.nodeType !== Node.ELEMENT_NODE) continue;
        if (added.classList.contains("graph-node")) touched.add(added);
        for (const node of added.querySelectorAll(".graph-node")) touched.add(node);
      }
    }
    // The run's graph only: the launch panel's preview of a workflow is never run.
    for (const node of touched) {
      if (node.closest("#graph")) push(node.dataset.blockId, node.dataset.status);
    }
  }).observe(document, {
    subtree: true, childList: true, attributes: true,
    attributeFilter: ["data-status"], attributeOldValue: true,
  });
})();"""

APPROVED = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}},
}


def review_workflow(workflow_id: str) -> dict[str, Any]:
    """intake, then three branches: a delay, an llm draft (retried once), and an escalation
    only urgent input takes; the first two meet at an approval with two conditional exits."""
    return {
        "id": workflow_id,
        "name": "Draft, review, publish",
        "blocks": [
            {"id": "intake", "type": "transform", "config": {"value": "{{ input.topic }}"}},
            {"id": "research", "type": "delay", "config": {"ms": 300}},
            {
                "id": "draft",
                "type": "llm",
                "config": {
                    "model": "fake-1",
                    "messages": [{"role": "user", "content": "{{ blocks.intake.output }}"}],
                },
                "retry": {"attempts": 2, "backoffMs": 300},
            },
            {"id": "escalate", "type": "transform", "config": {"value": "urgent"}},
            {"id": "page-oncall", "type": "transform", "config": {"value": "paged"}},
            {
                "id": "review",
                "type": "approval",
                "config": {"prompt": "Publish it?", "schema": APPROVED},
            },
            {"id": "publish", "type": "transform", "config": {"value": "published"}},
            {"id": "archive", "type": "transform", "config": {"value": "archived"}},
        ],
        "edges": [
            {"from": "intake", "to": "research"},
            {"from": "intake", "to": "draft"},
            {"from": "intake", "to": "escalate", "when": "input.urgent"},
            {"from": "escalate", "to": "page-oncall"},
            {"from": "research", "to": "review"},
            {"from": "draft", "to": "review"},
            {"from": "review", "to": "publish", "when": "blocks.review.output.approved"},
            {"from": "review", "to": "archive", "when": "not blocks.review.output.approved"},
        ],
    }


def node(page: Page, block_id: str) -> Any:
    return page.locator(f'#graph .graph-node[data-block-id="{block_id}"]')


async def expect_statuses(page: Page, statuses: dict[str, str]) -> None:
    for block_id, status in statuses.items():
        await expect(node(page, block_id)).to_have_attribute(
            "data-status", status, timeout=SETTLE_MS
        )


async def graph_clip(page: Page) -> dict[str, float]:
    """The run panel from its head to the bottom of the graph, in page coordinates."""
    clip: dict[str, float] = await page.evaluate(
        """() => {
          const run = document.querySelector("#run").getBoundingClientRect();
          const graph = document.querySelector("#graph").getBoundingClientRect();
          return { x: run.left + scrollX, y: run.top + scrollY, width: run.width,
                   height: graph.bottom - run.top + 16 };
        }"""
    )
    return clip


async def history(page: Page) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = await page.evaluate("window.graphHistory")
    return seen


@pytest.mark.timeout(90)
async def test_graph_nodes_follow_a_run_with_a_retry_a_skipped_branch_and_a_pause(
    plugged: FlowcastServer, page: Page, llm: FakeLLM, unique: str, tmp_path: Path
) -> None:
    llm.reset()
    # Attempt 1 is held long enough to be seen running, then fails with a retryable 500.
    llm.script(
        Reply(status=500, delay=2.5),
        Reply(pieces=["A ", "fresh ", "draft."], piece_delay=0.1),
    )
    workflow_id = f"review-{unique}"
    await page.add_init_script(STATUS_RECORDER)
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, review_workflow(workflow_id))
        await page.set_viewport_size({"width": 1360, "height": 900})  # a wide run panel
        await page.goto(plugged.url)
        execution_id = await start(page, workflow_id, {"topic": "graphs", "urgent": False})

        await expect(node(page, "draft")).to_have_attribute("data-status", "running")
        await expect(page.locator("#graph .graph-node")).to_have_count(8)
        await expect(page.locator("#graph .graph-when")).to_have_text(
            ["input.urgent", "blocks.review.output.approved", "not blocks.review.output.approved"]
        )
        await expect_statuses(
            page,
            {
                "review": "paused",
                "intake": "completed",
                "research": "completed",
                "draft": "completed",
                "escalate": "skipped",
                "page-oncall": "skipped",
                "publish": "pending",
                "archive": "pending",
            },
        )
        await expect(node(page, "review").locator(".graph-state")).to_have_text("paused · approval")
        await expect(node(page, "draft").locator(".graph-state")).to_have_text(
            "completed · llm · try 2"
        )
        skipped = page.locator('#graph .graph-edge[data-from="intake"][data-to="escalate"]')
        await expect(skipped).to_have_attribute("data-state", "skipped")
        await page.screenshot(
            path=str(screenshot_path(tmp_path, "graph.png")),
            clip=await graph_clip(page),
            full_page=True,
            animations="disabled",
        )

        # A block that has not run has no row to show: the graph says so.
        await node(page, "publish").click()
        await expect(page.locator("#graph .graph-note")).to_have_text(
            "publish has not run yet: it has no row in the timeline."
        )

        resumed = await client.post(
            f"/api/executions/{execution_id}/resume", json={"input": {"approved": True}}
        )
        assert resumed.status_code == 202, resumed.text
        await finished(page)
        await expect_statuses(
            page, {"review": "completed", "publish": "completed", "archive": "skipped"}
        )
        assert (await wait_finished(client, execution_id))["output"]["publish"] == "published"

    seen = await history(page)
    # The retried block went back to running for its second attempt.
    assert [s for s in seen["draft"] if s != "pending"] == [
        "running",
        "retrying",
        "running",
        "completed",
    ], seen
    assert seen["review"][-3:] == ["paused", "running", "completed"], seen
    assert "running" not in seen["escalate"] + seen["page-oncall"], seen


async def test_graph_shows_a_recovery_rerunning_a_block(server: FlowcastServer, page: Page) -> None:
    # As in the recovery test above, the stream is answered in the browser, in two
    # connections: the second, with execution:recovered, once the graph shows the first.
    # The run is of parallel-report as stored, but for a block "gone".
    before = [
        ("execution:started", {"input": None}),
        ("block:started", {"blockId": "outline", "blockType": "transform", "attempt": 1}),
        ("block:completed", {"blockId": "outline", "output": {}, "durationMs": 2}),
        ("block:started", {"blockId": "usage", "blockType": "generate", "attempt": 1}),
        ("block:chunk", {"blockId": "usage", "text": "lost "}),
        ("block:started", {"blockId": "sales", "blockType": "delay", "attempt": 1}),
        ("block:started", {"blockId": "gone", "blockType": "delay", "attempt": 1}),
        ("block:failed", {"blockId": "sales", "error": {"code": "x", "message": "x"},
                          "attempt": 1, "willRetry": True}),
    ]  # fmt: skip
    after = [
        (
            "execution:recovered",
            {"reason": "worker_lost", "recovery": 1, "rerun": ["usage", "sales"],
             "completed": ["outline"]},
        ),
    ]  # fmt: skip
    release = asyncio.Event()
    connections: list[str] = []

    async def stream(route: Route) -> None:
        connections.append(route.request.url)
        if len(connections) == 1:
            body = sse_body(before, 1)
        else:
            await release.wait()
            body = sse_body(after, len(before) + 1)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        await route.fulfill(status=200, headers=headers, body=body)

    await page.add_init_script(STATUS_RECORDER)
    await page.route(re.compile(r"/api/executions/ex_recovered/stream"), stream)
    try:
        await page.goto(f"{server.url}/#ex_recovered")
        await expect_statuses(
            page,
            {"outline": "completed", "usage": "running", "sales": "retrying", "report": "pending"},
        )
    finally:
        release.set()
    await expect_statuses(page, {"usage": "running", "sales": "running"})
    await expect(node(page, "usage").locator(".graph-state")).to_have_text(
        "running · generate · re-run"
    )
    assert (await history(page))["sales"][-2:] == ["retrying", "running"]
    # A block the stored definition lacks (it was replaced since the run began) is named.
    await expect(page.locator("#graph .graph-note")).to_have_text(
        "The workflow was changed after this run started: gone not in the graph."
    )


def wide_workflow(workflow_id: str, *, layers: int = 25, width: int = 20) -> dict[str, Any]:
    """``layers`` x ``width`` transform blocks (500 by default, the limit), each fed by one to
    six blocks of the layer before or, now and then, of an earlier one; some edges carry
    conditions (all true)."""
    chance = random.Random(14)
    blocks = [
        {"id": f"b{layer:02d}-{row:02d}", "type": "transform", "config": {"value": layer}}
        for layer in range(layers)
        for row in range(width)
    ]
    edges: dict[tuple[str, str], dict[str, Any]] = {}
    for layer in range(1, layers):
        for row in range(width):
            for _ in range(chance.randint(1, 6)):
                back = (
                    chance.randint(2, min(5, layer)) if layer > 1 and chance.random() < 0.1 else 1
                )
                source = f"b{layer - back:02d}-{chance.randrange(width):02d}"
                edge: dict[str, Any] = {"from": source, "to": f"b{layer:02d}-{row:02d}"}
                if chance.random() < 0.05:
                    edge["when"] = "input.go"
                edges[(source, edge["to"])] = edge
    return {"id": workflow_id, "blocks": blocks, "edges": list(edges.values())}


NODES_INSIDE = """svg => {
  const frame = svg.getBoundingClientRect();
  const nodes = [...svg.querySelectorAll(".graph-node")];
  const outside = nodes.filter((node) => {
    const box = node.getBoundingClientRect();
    return box.width <= 0 || box.left < frame.left - 1 || box.right > frame.right + 1
      || box.top < frame.top - 1 || box.bottom > frame.bottom + 1;
  });
  return { nodes: nodes.length, outside: outside.length };
}"""

# The layout's own promises, on the same workflow: no two nodes overlap and every edge
# runs left to right.
LAYOUT_SOUND = """async workflow => {
  const { layoutWorkflow, LAYOUT } = await import("/static/graph-layout.js");
  const { nodes, edges } = layoutWorkflow(workflow);
  const { NODE_W, NODE_H } = LAYOUT;
  const at = new Map(nodes.map((node) => [node.id, node]));
  let overlaps = 0;
  const columns = Map.groupBy(nodes, (node) => node.x);
  for (const column of columns.values()) {
    column.sort((a, b) => a.y - b.y);
    for (let i = 1; i < column.length; i += 1) {
      if (column[i].y - column[i - 1].y < NODE_H) overlaps += 1;
    }
  }
  const backwards = edges.filter((e) => at.get(e.from).x + NODE_W >= at.get(e.to).x).length;
  return { nodes: nodes.length, edges: edges.length, overlaps, backwards };
}"""

VIEW = """svg => {
  const m = svg.querySelector(".graph-view").transform.baseVal.consolidate().matrix;
  return { scale: m.a, x: m.e, y: m.f };
}"""


@pytest.mark.timeout(120)
async def test_graph_of_500_blocks_fits_zooms_and_pans(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient, unique: str
) -> None:
    console: list[str] = []
    page.on(
        "console", lambda message: console.append(message.text) if message.type == "error" else None
    )
    workflow = wide_workflow(f"wide-{unique}")
    assert len(workflow["blocks"]) == 500 and len(workflow["edges"]) <= 2000
    await put(client, workflow)
    await page.goto(server.url)
    execution_id = await start(page, workflow["id"], {"go": True})

    canvas = page.locator("#graph .graph-canvas")
    await expect(page.locator("#graph .graph-node")).to_have_count(500, timeout=SETTLE_MS)
    await expect(page.locator("#graph .graph-when").first).to_have_text("input.go")
    await expect(page.locator("#graph .graph-node").first).to_be_visible()
    # Drawn fitted: every node inside the canvas, at a zoom too small for the words.
    assert await canvas.evaluate(NODES_INSIDE) == {"nodes": 500, "outside": 0}
    fitted = await canvas.evaluate(VIEW)
    assert 0.05 < fitted["scale"] < 0.5, fitted
    await expect(canvas).to_have_class(re.compile(r"\bfar\b"))
    assert await page.evaluate(LAYOUT_SOUND, workflow) == {
        "nodes": 500,
        "edges": len(workflow["edges"]),
        "overlaps": 0,
        "backwards": 0,
    }

    # The mouse acts on what is on screen: bring the canvas there (the list sits above it).
    await canvas.scroll_into_view_if_needed()
    box = await canvas.bounding_box()
    assert box is not None and box["height"] >= 300, box
    centre_x, centre_y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    await page.mouse.move(centre_x, centre_y)
    await page.mouse.wheel(0, -600)
    await page.wait_for_function(
        "scale => Number(document.querySelector('#graph .graph-canvas').dataset.zoom) > scale",
        arg=fitted["scale"] * 1.5,
        timeout=SETTLE_MS,
    )
    zoomed = await canvas.evaluate(VIEW)
    assert zoomed["scale"] > fitted["scale"] * 1.5, (fitted, zoomed)
    await page.click("#graph-zoom-in")
    assert (await canvas.evaluate(VIEW))["scale"] > zoomed["scale"]
    assert (await canvas.evaluate(NODES_INSIDE))["outside"] > 0

    before = await canvas.evaluate(VIEW)
    await page.mouse.move(centre_x, centre_y)
    await page.mouse.down()
    await page.mouse.move(centre_x - 120, centre_y - 40, steps=6)
    await page.mouse.up()
    panned = await canvas.evaluate(VIEW)
    assert panned["scale"] == before["scale"]
    moved = (panned["x"] - before["x"], panned["y"] - before["y"])
    assert moved == pytest.approx((-120, -40), abs=0.01), (before, panned)

    await page.click("#graph-fit")
    assert await canvas.evaluate(VIEW) == pytest.approx(fitted, abs=0.01)
    assert await canvas.evaluate(NODES_INSIDE) == {"nodes": 500, "outside": 0}

    await finished(page)
    await expect(page.locator('#graph .graph-node[data-status="completed"]')).to_have_count(500)
    assert (await wait_finished(client, execution_id))["status"] == "completed"
    assert console == []


async def test_clicking_a_graph_node_scrolls_to_its_timeline_row(
    server: FlowcastServer, page: Page, client: httpx.AsyncClient, unique: str
) -> None:
    fan = [f"part-{i:02d}" for i in range(20)]
    workflow = {
        "id": f"fan-{unique}",
        "blocks": [
            {"id": "split", "type": "transform", "config": {"value": 1}},
            *({"id": part, "type": "transform", "config": {"value": part}} for part in fan),
            {"id": "join", "type": "transform", "config": {"value": 2}},
        ],
        "edges": [
            *({"from": "split", "to": part} for part in fan),
            *({"from": part, "to": "join"} for part in fan),
        ],
    }
    await put(client, workflow)
    await page.goto(server.url)
    await start(page, workflow["id"], {})
    await finished(page)
    await expect(node(page, "join")).to_have_attribute("data-status", "completed")

    row = block(page, "join")
    await page.evaluate("window.scrollTo(0, 0)")
    await expect(row).not_to_be_in_viewport()
    await node(page, "join").click()
    await expect(row).to_be_in_viewport()
    await expect(row).to_have_class(re.compile(r"\bhighlighted\b"))
    await expect(node(page, "join")).to_have_class(re.compile(r"\bselected\b"))

    # Another node moves the highlight; a keyboard user gets there with Enter.
    await node(page, "split").focus()
    await page.keyboard.press("Enter")
    await expect(block(page, "split")).to_be_in_viewport()
    await expect(block(page, "split")).to_have_class(re.compile(r"\bhighlighted\b"))
    await expect(row).not_to_have_class(re.compile(r"\bhighlighted\b"))


# ---------------------------------------------------------------- an llm block


# The block's text while it still streams: longer than ``before`` and not yet all of it,
# read in the same frame as the run's and the block's status, both still "running".
PARTIAL_TEXT = """({ blockId, before, full }) => {
  const row = document.querySelector(`#timeline li.block[data-block-id="${blockId}"]`);
  if (!row) return null;
  const text = row.querySelector("pre.chunks").textContent;
  const running = document.querySelector("#run-status").dataset.status === "running"
    && row.dataset.status === "running";
  return running && text.length > before.length && text !== full ? text : null;
}"""


async def partial_text(page: Page, block_id: str, before: str, full: str) -> str:
    """Wait for the block's text to grow past ``before`` while the run is running."""
    handle = await page.wait_for_function(
        PARTIAL_TEXT,
        arg={"blockId": block_id, "before": before, "full": full},
        polling=20,
        timeout=SETTLE_MS,
    )
    text: str = await handle.json_value()
    return text


async def test_an_llm_blocks_tokens_show_as_live_text(
    plugged: FlowcastServer, page: Page, llm: FakeLLM, unique: str
) -> None:
    pieces = ["Tokens ", "arrive ", "one ", "by ", "one, ", "live."]
    full = "".join(pieces)
    llm.reset()
    llm.script(Reply(pieces=pieces, piece_delay=0.2))
    workflow = {
        "id": f"llm-{unique}",
        "blocks": [
            {
                "id": "draft",
                "type": "llm",
                "config": {
                    "model": "fake-1",
                    "messages": [{"role": "user", "content": "Say {{ input.what }}"}],
                },
            }
        ],
        "edges": [],
    }
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, workflow)
        await page.goto(plugged.url)
        execution_id = await start(page, f"llm-{unique}", {"what": "something slowly"})

        # Seen twice mid-stream, each time a longer prefix, before the block completes.
        first = await partial_text(page, "draft", "", full)
        second = await partial_text(page, "draft", first, full)
        assert full.startswith(first) and full.startswith(second), (first, second)
        assert 0 < len(first) < len(second) < len(full), (first, second)

        await finished(page)
        snapshot = await wait_finished(client, execution_id)
        events = await all_events(client, execution_id)
    draft = block(page, "draft")
    await expect(draft.locator(".chunks")).to_have_text(full)
    await expect(draft.locator(".status")).to_have_text("completed")
    await expect(draft.locator(".kind")).to_have_text("llm")
    await expect(page.locator('#events li[data-type="block:chunk"]')).to_have_count(len(pieces))
    assert [e["data"]["text"] for e in events if e["type"] == "block:chunk"] == pieces
    assert snapshot["status"] == "completed"
    assert snapshot["output"]["draft"]["text"] == full
    (seen,) = llm.requests
    assert seen.body["messages"] == [{"role": "user", "content": "Say something slowly"}]


# ---------------------------------------------------------------- the list of executions


@pytest.fixture(scope="module")
async def listed(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    """A server of its own (own prefix), so its list holds only what a test starts."""
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("page-list"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"pl{uuid.uuid4().hex[:6]}",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    yield server
    await server.stop()


def approval_workflow(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "review", "type": "approval", "config": {"prompt": "Ship it?", "schema": {}}},
            {"id": "ship", "type": "transform", "config": {"value": "shipped"}},
        ],
        "edges": [{"from": "review", "to": "ship"}],
    }


def list_row(page: Page, execution_id: str) -> Any:
    return page.locator(f'#list-rows tr[data-execution-id="{execution_id}"]')


async def listed_ids(page: Page) -> list[str]:
    ids: list[str] = await page.locator("#list-rows tr").evaluate_all(
        "rows => rows.map(row => row.dataset.executionId)"
    )
    return ids


async def test_the_list_shows_runs_started_elsewhere_live_and_a_click_attaches(
    listed: FlowcastServer, page: Page, unique: str
) -> None:
    lists: list[str] = []
    page.on(
        "request",
        lambda request: lists.append(request.url) if "/api/executions" in request.url else None,
    )
    async with httpx.AsyncClient(base_url=listed.url, timeout=20) as client:
        waiting, quick = f"wait-{unique}", f"quick-{unique}"
        await put(client, approval_workflow(waiting))
        await put(client, quick_workflow(quick))
        await page.goto(listed.url)
        await expect(page.locator("#list-connection")).to_have_text("live")
        await expect(page.locator("#list-empty")).to_be_visible()

        # Started through the API, not the page: the rows come and change by themselves.
        first = await execute(client, waiting)
        row = list_row(page, first)
        await expect(row.locator(".status")).to_have_text("paused", timeout=SETTLE_MS)
        await expect(row.locator(".workflow")).to_have_text(waiting)
        # Dated, whatever the day (issue 26: times alone did not say which day).
        await expect(row.locator(".at")).to_have_text(DATE_TIME)
        done = await execute(client, quick)
        await expect(list_row(page, done).locator(".status")).to_have_text(
            "completed", timeout=SETTLE_MS
        )
        await expect(list_row(page, done).locator(".duration")).to_have_text(
            re.compile(r"^\d+(\.\d)? m?s$")
        )
        resumed = await client.post(f"/api/executions/{first}/resume", json={"input": {}})
        assert resumed.status_code == 202, resumed.text
        await expect(row.locator(".status")).to_have_text("completed", timeout=SETTLE_MS)
        second = await execute(client, waiting)
        await expect(list_row(page, second).locator(".status")).to_have_text(
            "paused", timeout=SETTLE_MS
        )
        await expect(page.locator("#list-empty")).to_be_hidden()
        assert await listed_ids(page) == [second, done, first]  # newest first

        # Filters: by status, then by workflow.
        await page.select_option("#list-status", "paused")
        await expect(page.locator("#list-rows tr")).to_have_count(1)
        await expect(list_row(page, second)).to_be_visible()
        await page.select_option("#list-status", "")
        # Each filter opens its own list once the last one is shown: two changes in a row
        # may be joined into one open (the page drops a connect a newer one superseded).
        await expect(page.locator("#list-rows tr")).to_have_count(3)
        await page.select_option("#list-workflow", quick)
        await expect(page.locator("#list-rows tr")).to_have_count(1)
        await expect(list_row(page, done)).to_be_visible()
        # Still live under a filter: a new run of that workflow shows.
        another = await execute(client, quick)
        await expect(list_row(page, another).locator(".status")).to_have_text(
            "completed", timeout=SETTLE_MS
        )
        await page.select_option("#list-workflow", "")
        await expect(page.locator("#list-rows tr")).to_have_count(4)

        # A click on a row attaches: the hash names it, the timeline shows it.
        await list_row(page, second).locator(".workflow").click()
        await expect(page.locator("#run-id")).to_have_text(second)
        assert page.url.endswith(f"#{second}")
        await expect(page.locator("#pause")).to_be_visible()
        await expect(block(page, "review").locator(".status")).to_have_text("waiting")
        await expect(list_row(page, second)).to_have_attribute("aria-current", "true")
        # From the keyboard too: the row's link takes focus and Enter follows it.
        await list_row(page, done).locator("a").focus()
        await page.keyboard.press("Enter")
        await expect(page.locator("#run-id")).to_have_text(done)
        await finished(page)
        await page.reload()
        await expect(page.locator("#run-id")).to_have_text(done)
        await finished(page)
        await expect(list_row(page, done)).to_have_attribute("aria-current", "true")

        cancelled = await client.post(f"/api/executions/{second}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        await expect(list_row(page, second).locator(".status")).to_have_text(
            "cancelled", timeout=SETTLE_MS
        )

    # No polling: one live list per connection (the first, four filter changes, the
    # reload's), and never the JSON list.
    assert not [url for url in lists if re.search(r"/api/executions(\?|$)", url)], lists
    live = [url for url in lists if "/api/executions/live?" in url]
    assert len(live) == 6, live


async def test_with_an_api_key_the_list_links_each_run_with_its_stream_token(
    guarded: FlowcastServer, page: Page, keyed_client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"keyed-list-{unique}"
    await put(keyed_client, quick_workflow(workflow_id))
    await page.goto(guarded.url)
    await expect(page.locator("#list-error")).to_contain_text("API key")
    await use_key(page)
    await expect(page.locator("#list-error")).to_be_hidden()
    await page.select_option("#list-workflow", workflow_id)
    execution_id = await execute(keyed_client, workflow_id)
    row = list_row(page, execution_id)
    await expect(row.locator(".status")).to_have_text("completed", timeout=SETTLE_MS)
    # This server ends every SSE connection after 1.5 s: EventSource opens the list
    # again (its token still good), and the row is still there.
    async with page.expect_request(lambda request: "/api/executions/live?" in request.url):
        pass
    await expect(page.locator("#list-connection")).to_have_text("live")
    await row.locator("a").click()
    await expect(page.locator("#run-id")).to_have_text(execution_id)
    assert f"#{execution_id}&token=" in page.url
    await finished(page)
    await expect(block(page, "only").locator(".status")).to_have_text("completed")


async def test_screenshot_of_the_list_with_runs_in_every_status(
    valkey: ValkeyServer, page: Page, tmp_path: Path
) -> None:
    # A server of its own: the list shows only these runs.
    server = FlowcastServer(
        data_dir=tmp_path / "server",
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"ps{uuid.uuid4().hex[:6]}",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    try:
        await screenshot_the_list(server, page, tmp_path)
    finally:
        await server.stop()


async def screenshot_the_list(server: FlowcastServer, page: Page, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        await put(
            client,
            {
                "id": "import-orders",
                "name": "Import the night's orders",
                "blocks": [
                    {"id": "fetch", "type": "delay", "config": {"ms": 300}},
                    {
                        "id": "validate",
                        "type": "fail",
                        "config": {"message": "row 17 has no customer id"},
                    },
                ],
                "edges": [{"from": "fetch", "to": "validate"}],
            },
        )
        report = await execute(client, "parallel-report", {"topic": "the week"})
        failed = await execute(client, "import-orders")
        story = await execute(client, "stream-story", {"hero": "a list", "tokensPerSecond": 20})
        refund = await execute(client, "approve-refund", {"amount": 40, "customer": "Globex"})
        dropped = await execute(client, "stream-story", {"tokensPerSecond": 2})
        running = await execute(client, "stream-story", {"tokensPerSecond": 1})
        await page.goto(server.url)
        await expect(list_row(page, dropped).locator(".status")).to_have_text("running")
        assert (await client.post(f"/api/executions/{dropped}/cancel")).status_code == 202
        expected = {
            report: "completed",
            failed: "failed",
            story: "completed",
            refund: "paused",
            dropped: "cancelled",
            running: "running",
        }
        for execution_id, status in expected.items():
            await expect(list_row(page, execution_id).locator(".status")).to_have_text(
                status, timeout=SETTLE_MS
            )
        await page.set_viewport_size({"width": 1360, "height": 1040})
        await list_row(page, report).locator("a").click()
        await finished(page)
        await expect(page.locator("#graph .graph-node")).to_have_count(5)
        await expect(page.locator("#preview .graph-node")).to_have_count(5)
        # The page as a person sees it: the start form and the list on the left, the
        # watched run's row marked, and that run on the right.
        await page.evaluate("window.scrollTo(0, 0)")
        await page.screenshot(
            path=str(screenshot_path(tmp_path, "executions.png")), animations="disabled"
        )
        for execution_id in (running, refund):
            assert (await client.post(f"/api/executions/{execution_id}/cancel")).status_code == 202
