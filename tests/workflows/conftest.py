"""Fixtures for the workflow tests: real templates, block types and an HTTP client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from lib.workflows.blocks import BlockServices, BlockTypes, PluginHandler
from lib.workflows.executor import Executor, RunState
from lib.workflows.model import Workflow
from lib.workflows.pool import TemplatePool
from lib.workflows.templates import Templates


@dataclass
class Recorder:
    """Collects what the executor emits, in order."""

    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    checkpoints: list[tuple[str, bytes]] = field(default_factory=list)

    def __call__(self, type: str, data: dict[str, Any], checkpoint: Any = ()) -> None:
        self.events.append((type, data))
        self.checkpoints.extend(checkpoint)

    def of(self, type: str, block_id: str | None = None) -> list[dict[str, Any]]:
        return [
            data
            for kind, data in self.events
            if kind == type and (block_id is None or data.get("blockId") == block_id)
        ]

    def kinds(self, block_id: str) -> list[str]:
        return [kind for kind, data in self.events if data.get("blockId") == block_id]


@pytest.fixture
def templates() -> Templates:
    return Templates()


@pytest.fixture
async def template_pool() -> AsyncIterator[TemplatePool]:
    """Real worker processes, started only when a template is more than a plain path."""
    async with TemplatePool(size=2) as pool:
        yield pool


@pytest.fixture
async def http_client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture
def services(http_client: httpx.AsyncClient, template_pool: TemplatePool) -> BlockServices:
    return BlockServices(
        http=http_client,
        templates=template_pool,
        http_limiter=asyncio.Semaphore(16),
        http_allow_private=True,
    )


RunWorkflow = Callable[..., Any]


@pytest.fixture
def run_workflow(services: BlockServices) -> RunWorkflow:
    """Run a workflow dict with optional plugins; returns (output, recorder)."""

    async def run(
        definition: dict[str, Any],
        *,
        input: Any = None,
        plugins: Mapping[str, PluginHandler] | None = None,
        concurrency: int = 8,
        recorder: Recorder | None = None,
        state: RunState | None = None,
    ) -> tuple[dict[str, Any], Recorder]:
        recorder = recorder if recorder is not None else Recorder()
        executor = Executor(BlockTypes.builtin(plugins or {}), services, concurrency=concurrency)
        workflow = Workflow.model_validate(definition)
        output = await executor.run(
            workflow, execution_id="ex_test", input=input, emit=recorder, state=state
        )
        return output, recorder

    return run


def workflow(
    blocks: list[dict[str, Any]], edges: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A workflow definition with the given blocks and edges."""
    return {"id": "test", "blocks": blocks, "edges": edges or []}
