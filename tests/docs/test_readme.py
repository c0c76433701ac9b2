"""The README, checked against the code and a live server so it cannot drift: its shell
examples run as written (conventions in ``tests/support/docs.py``), its sample frame is
what a run sends, its configuration table lists every setting with its default, and its
links stay inside the repository."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.settings import Settings
from tests.support.api import all_events, wait_finished
from tests.support.docs import ROOT, run_examples, shell_blocks
from tests.support.servers import FlowcastServer

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# What a `sh notest` block may do that a test cannot: start a server of its own, build or
# run containers, call make, reach a model, or run for minutes.
UNTESTABLE = ("make ", "docker ", "flowcast serve", "uvicorn ", "ollama ", "stress.run")


@pytest.mark.timeout(120)
async def test_the_readme_shell_examples_run_against_a_live_server(
    server: FlowcastServer,
) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the examples use curl, which is not installed")
    assert await run_examples(README, url=server.url) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_examples_left_untested_are_only_what_a_test_cannot_run(page: Path) -> None:
    for block in shell_blocks(page):
        if not block.tested:
            text = "\n".join(block.lines)
            assert any(mark in text for mark in UNTESTABLE), f"{page.name}:{block.line}"


def shown_frame() -> dict[str, Any]:
    """The SSE frame the README shows under "Each event is one SSE frame"."""
    text = README.read_text()
    found = re.search(r"Each event is one SSE frame.*?```text\n(.*?)```", text, re.DOTALL)
    assert found is not None, "the README shows no sample frame"
    fields = dict(line.split(": ", 1) for line in found.group(1).splitlines())
    envelope: dict[str, Any] = orjson.loads(fields["data"])
    assert int(fields["id"]) == envelope["id"] and fields["event"] == envelope["type"]
    return envelope


async def test_the_sample_frame_is_what_a_run_of_its_workflow_sends(
    client: httpx.AsyncClient,
) -> None:
    shown = shown_frame()
    response = await client.post(f"/api/workflows/{shown['workflowId']}/execute", json={})
    execution_id = response.json()["executionId"]
    await wait_finished(client, execution_id)
    sent = next(e for e in await all_events(client, execution_id) if e["id"] == shown["id"])

    def comparable(event: dict[str, Any]) -> dict[str, Any]:
        # What differs from run to run: the execution, the time, how long a block took.
        data = {k: v for k, v in event["data"].items() if k != "durationMs"}
        return {**event, "executionId": "", "ts": "", "data": data}

    assert comparable(sent) == comparable(shown)
    assert list(sent) == list(shown) and list(sent["data"]) == list(shown["data"])


def configuration_rows() -> dict[str, str]:
    """Each variable of the README's configuration table, with its default cell."""
    section = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        names = re.findall(r"`(FLOWCAST_[A-Z0-9_]+)`", cells[0]) if len(cells) == 3 else []
        defaults = [part.strip() for part in cells[1].split(",")] if names else []
        for index, name in enumerate(names):
            rows[name] = defaults[index] if len(defaults) == len(names) else cells[1]
    return rows


def test_every_setting_is_in_the_configuration_table_with_its_default() -> None:
    rows = configuration_rows()
    for name, info in Settings.model_fields.items():
        variable = f"FLOWCAST_{name.upper()}"
        assert variable in rows, f"the README's configuration table lacks {variable}"
        cell, default = rows[variable].strip("`"), info.default
        if default is None or default == "":
            assert cell.startswith("unset"), (variable, cell)
        elif isinstance(default, bool):
            assert cell == str(default).lower(), (variable, cell)
        elif isinstance(default, int | float):
            number = int(default) if default == int(default) else default
            assert cell == str(number), (variable, cell)
        else:
            assert str(default) in cell, (variable, cell)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_point_at_files_and_headings_inside_the_repository(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
        assert linked.exists(), f"{page.name} links to a missing file: {target}"
        if anchor:
            assert anchor in anchors(linked), f"{page.name} links to a missing heading: {target}"
