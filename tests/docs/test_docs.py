"""docs/*.md, checked against a live server: every shell example runs as written, the
plugin code shown is the shipped one, and the API reference names every route and
status the server's OpenAPI document lists."""

from __future__ import annotations

import re
import shlex
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.docs import ROOT, commands, run_examples, shell_blocks
from tests.support.llm import FakeLLM, llm
from tests.support.servers import FlowcastServer, ValkeyServer

__all__ = ["llm"]  # the module's fake provider (tests/support/llm.py)

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def serve_settings() -> dict[str, str]:
    """The variables docs/workflows.md starts its server with (its ``flowcast serve``)."""
    for block in shell_blocks(DOCS / "workflows.md"):
        for command in commands(block):
            words = shlex.split(command.text.replace("\\\n", " "))
            if words[-2:] == [".venv/bin/flowcast", "serve"]:
                return dict(word.split("=", 1) for word in words[:-2])
    raise AssertionError("docs/workflows.md shows no `flowcast serve` line")


@pytest.fixture(scope="module")
async def docs_server(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer, llm: FakeLLM
) -> AsyncIterator[FlowcastServer]:
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("docs"),
        env={
            **serve_settings(),
            # The model is the scripted one here, not an Ollama.
            "FLOWCAST_LLM_BASE_URL": llm.url,
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"docs{uuid.uuid4().hex[:6]}",
            # Approval deadlines are checked every half lease: the example's comes sooner.
            "FLOWCAST_LEASE_SECONDS": "2",
        },
    )
    await server.start()
    yield server
    await server.stop()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
async def test_every_shell_example_in_the_docs_runs_as_written(
    page: Path, docs_server: FlowcastServer
) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the examples use curl, which is not installed")
    await run_examples(page, url=docs_server.url)


def test_the_plugin_code_in_the_docs_is_the_shipped_module() -> None:
    shown = re.search(r"```python\n(.*?)```", (DOCS / "workflows.md").read_text(), re.DOTALL)
    assert shown is not None
    assert (ROOT / "examples" / "plugins.py").read_text().endswith(shown.group(1))


def route_sections() -> dict[tuple[str, str], str]:
    """docs/api.md's routes (``### `METHOD /path` ``), each with the text under it."""
    text = (DOCS / "api.md").read_text()
    sections: dict[tuple[str, str], str] = {}
    parts = re.split(r"^### `([A-Z]+) (/[^`]*)`$", text, flags=re.MULTILINE)
    for method, path, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        sections[(method, re.sub(r"\{[^}]+\}", "{}", path))] = body
    return sections


async def test_the_api_reference_has_every_route_and_status_of_the_openapi_document(
    docs_server: FlowcastServer,
) -> None:
    async with httpx.AsyncClient(base_url=docs_server.url, timeout=20) as client:
        document = (await client.get("/openapi.json")).json()
    sections = route_sections()
    common = (DOCS / "api.md").read_text().split("\n### ", 1)[0]
    for raw_path, operations in document["paths"].items():
        path = re.sub(r"\{[^}]+\}", "{}", raw_path)
        for method, operation in operations.items():
            key = (method.upper(), path)
            assert key in sections, f"docs/api.md has no section for {key}"
            statuses = set(operation["responses"])
            if "requestBody" not in operation:
                # FastAPI's own, for path parameters that are any string: never answered.
                statuses.discard("422")
            for status in statuses:
                told = re.search(rf"\b{status}\b", sections[key])
                if status in ("401", "413", "415", "503") and path.startswith("/api/"):
                    told = told or re.search(rf"\b{status}\b", common)
                assert told, f"docs/api.md says nothing of {status} for {key}"
    documented = {key for key in sections}
    served = {
        (method.upper(), re.sub(r"\{[^}]+\}", "{}", path))
        for path, operations in document["paths"].items()
        for method in operations
    }
    assert documented - served <= {("GET", "/")}, documented - served
