"""Where workflows live: files loaded by each process at start, and the API's in Redis.

Workflows registered through the API are stored per tenant in one Redis hash, so every
replica sees them. Files from the workflows directory are a read-only layer under them,
visible to every tenant; an API workflow with the same id shadows the file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson
from redis.asyncio import Redis

from lib.backend import Keys, translating
from lib.errors import Conflict, FlowcastError, InvalidInput, NotFound, Problem, WorkflowInvalid
from lib.workflows.model import Workflow

log = logging.getLogger(__name__)

Validate = Callable[[Any], Workflow]
# Problems a workflow has only against this server's configuration (an llm provider
# it names is not configured): refused when stored, not when read back.
Admit = Callable[[Workflow], list[Problem]]


@dataclass(frozen=True)
class StoredWorkflow:
    workflow: Workflow
    source: str  # "api" or "file"


@dataclass(frozen=True)
class FileProblem:
    path: Path
    message: str


def load_directory(
    directory: Path, validate: Validate
) -> tuple[dict[str, Workflow], list[FileProblem]]:
    """Load every ``*.json`` workflow in a directory; bad files are reported, not fatal."""
    loaded: dict[str, Workflow] = {}
    problems: list[FileProblem] = []
    if not directory.is_dir():
        return loaded, [FileProblem(directory, "the workflows directory does not exist")]
    for path in sorted(directory.glob("*.json")):
        try:
            workflow = validate(orjson.loads(path.read_bytes()))
        except orjson.JSONDecodeError as exc:
            problems.append(FileProblem(path, f"not valid JSON: {exc}"))
            continue
        except InvalidInput as exc:
            details = "; ".join(f"{p.path}: {p.message}" for p in exc.problems)
            problems.append(FileProblem(path, f"{exc.message}: {details}"))
            continue
        except OSError as exc:
            problems.append(FileProblem(path, f"unreadable: {exc}"))
            continue
        if workflow.id in loaded:
            problems.append(FileProblem(path, f"workflow id {workflow.id!r} is defined twice"))
            continue
        loaded[workflow.id] = workflow
    return loaded, problems


class WorkflowStore:
    """Create, read, list and delete workflows for one tenant at a time."""

    def __init__(
        self,
        *,
        redis: Redis,
        validate: Validate,
        files: dict[str, Workflow] | None = None,
        prefix: str = "fc",
        admit: Admit | None = None,
    ) -> None:
        self._redis = redis
        self._validate = validate
        # One check at a time, in a thread: the event loop then shares the GIL with one
        # other thread only, however many workflows are being stored at once.
        self._checking = asyncio.Semaphore(1)
        self._admit = admit
        self._files = dict(files or {})
        self._keys = Keys(prefix)
        # Parsed workflows by their stored bytes: a stored definition is validated once.
        self._parsed: dict[bytes, Workflow] = {}

    def _key(self, tenant: str) -> str:
        return self._keys.workflows(tenant)

    async def _parse(self, raw: bytes) -> Workflow:
        workflow = self._parsed.get(raw)
        if workflow is None:
            async with self._checking:  # off the loop, as when it was stored
                workflow = await asyncio.to_thread(self._validate, orjson.loads(raw))
            if len(self._parsed) > 1024:
                self._parsed.clear()
            self._parsed[raw] = workflow
        return workflow

    async def put(self, tenant: str, workflow_id: str, body: Any) -> tuple[Workflow, bool]:
        """Validate and store; returns the workflow and whether it was created."""
        if isinstance(body, dict) and "id" not in body:
            body = {**body, "id": workflow_id}
        # Off the event loop: checking a tenant's templates costs what their shape costs
        # (5,000 chained attributes: ~0.25 s), and every tenant's requests wait on the loop.
        async with self._checking:
            workflow = await asyncio.to_thread(self._validate, body)
        problems = self._admit(workflow) if self._admit else []
        if problems:
            raise WorkflowInvalid(problems)
        if workflow.id != workflow_id:
            raise InvalidInput(
                "the workflow's id does not match the URL",
                [Problem("$.id", f"expected {workflow_id!r}, got {workflow.id!r}")],
            )
        raw = orjson.dumps(workflow.model_dump(by_alias=True, exclude_none=True, mode="json"))
        with translating("store the workflow"):
            created = await self._redis.hset(self._key(tenant), workflow_id, raw)
        return workflow, bool(created) and workflow_id not in self._files

    async def get(self, tenant: str, workflow_id: str) -> StoredWorkflow:
        with translating("read the workflow"):
            raw = cast(bytes | None, await self._redis.hget(self._key(tenant), workflow_id))
        if raw is not None:
            return StoredWorkflow(await self._parse(raw), "api")
        if workflow_id in self._files:
            return StoredWorkflow(self._files[workflow_id], "file")
        raise NotFound("workflow", workflow_id)

    async def list(self, tenant: str) -> list[StoredWorkflow]:
        with translating("list workflows"):
            stored = cast(dict[bytes, bytes], await self._redis.hgetall(self._key(tenant)))
        found: dict[str, StoredWorkflow] = {
            workflow_id: StoredWorkflow(workflow, "file")
            for workflow_id, workflow in self._files.items()
        }
        for raw_id, raw in stored.items():
            try:
                found[raw_id.decode()] = StoredWorkflow(await self._parse(raw), "api")
            except FlowcastError as exc:
                # A stored workflow can turn invalid when plugins change; keep listing.
                log.warning(
                    "stored workflow no longer valid",
                    extra={"workflowId": raw_id, "error": str(exc)},
                )
        return [found[key] for key in sorted(found)]

    async def delete(self, tenant: str, workflow_id: str) -> None:
        with translating("delete the workflow"):
            removed = await self._redis.hdel(self._key(tenant), workflow_id)
        if removed:
            return
        if workflow_id in self._files:
            raise Conflict(
                "workflow_from_file",
                f"workflow {workflow_id!r} is loaded from a file; remove the file instead",
            )
        raise NotFound("workflow", workflow_id)
