"""Where workflows live: files loaded by each process at start, and the API's in Redis.

Workflows registered through the API are stored per tenant in one Redis hash, so every
replica sees them. Files from the workflows directory are a read-only layer under them,
visible to every tenant; an API workflow with the same id shadows the file.

A start need not read its workflow first: the store keeps each workflow as this process
last read or wrote it (``known``), and a start goes on with that one, its document read
again in the start's own round trip (``confirm_in``). Another replica may have replaced
or deleted it since: then the start is taken back and the workflow read afresh, so an
execution always runs the version that was current when it was accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson
from redis.asyncio import Redis

from lib.backend import Batch, Keys, translating
from lib.backoff import Backoff
from lib.errors import (
    Conflict,
    FlowcastError,
    InvalidInput,
    NotFound,
    Problem,
    WorkflowChanged,
    WorkflowInvalid,
)
from lib.quota import StorageQuota, workflow_member
from lib.tenancy import FairGate
from lib.workflows.model import Workflow

log = logging.getLogger(__name__)

Validate = Callable[[Any], Workflow]
# Problems a workflow has only against this server's configuration (an llm provider
# it names is not configured): refused when stored, not when read back.
Admit = Callable[[Workflow], list[Problem]]
# Past this many, the workflows known by (tenant, id) are forgotten (and read again).
KNOWN_MAX = 1024
# The longest one PUT of a workflow holds its turn (others of the same workflow wait).
PUT_TURN_MS = 5000


@dataclass(frozen=True)
class StoredWorkflow:
    workflow: Workflow
    source: str  # "api" or "file"
    raw: bytes | None = None  # the document as the store held it; None for a file's


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
        quota: StorageQuota | None = None,
    ) -> None:
        self._redis = redis
        self._quota = quota
        self._validate = validate
        # One check at a time, in a thread: the event loop then shares the GIL with one
        # other thread only, however many workflows are being stored at once.
        # Shared fairly between tenants: one tenant's backlog of costly checks holds
        # another's for one check, not all of them (the step 16 fresh-eyes review).
        self._checking = FairGate(1)
        self._admit = admit
        self._files = dict(files or {})
        self._keys = Keys(prefix)
        # Parsed workflows by their stored bytes: a stored definition is validated once.
        self._parsed: dict[bytes, Workflow] = {}
        # Each workflow as this process last read or wrote it, by (tenant, id).
        self._known: dict[tuple[str, str], StoredWorkflow] = {}

    def _key(self, tenant: str) -> str:
        return self._keys.workflows(tenant)

    def replace_files(self, files: dict[str, Workflow]) -> None:
        """The workflow files as read again: executions started from now on run these
        (running ones keep the version they started with)."""
        self._files = dict(files)
        # A file's workflow remembered here is confirmed by the store holding nothing
        # under its id, so an old copy would outlive its file: forget them all.
        self._known = {key: known for key, known in self._known.items() if known.raw is not None}

    async def _parse(self, raw: bytes, tenant: str) -> Workflow:
        workflow = self._parsed.get(raw)
        if workflow is None:
            async with self._checking.entered(tenant):  # off the loop, as when stored
                workflow = await asyncio.to_thread(self._validate, orjson.loads(raw))
            if len(self._parsed) > 1024:
                self._parsed.clear()
            self._parsed[raw] = workflow
        return workflow

    def _remember(self, tenant: str, workflow_id: str, stored: StoredWorkflow | None) -> None:
        if stored is None:
            self._known.pop((tenant, workflow_id), None)
            return
        if len(self._known) >= KNOWN_MAX:
            self._known.clear()
        self._known[(tenant, workflow_id)] = stored

    def known(self, tenant: str, workflow_id: str) -> StoredWorkflow | None:
        """The workflow as this process last read or wrote it, or None. A start may go
        on with it only if its round trip confirms it (``confirm_in``)."""
        return self._known.get((tenant, workflow_id))

    def confirm_in(
        self, batch: Batch, tenant: str, workflow_id: str, stored: StoredWorkflow
    ) -> None:
        """Read the workflow's document as one command of ``batch``: its answer raises
        ``WorkflowChanged`` unless the store still holds ``stored`` (replaced or deleted
        by another replica since; then no longer known here)."""
        key = (tenant, workflow_id)

        def confirmed(raw: bytes | None) -> None:
            if raw != stored.raw:
                if self._known.get(key) is stored:
                    del self._known[key]
                raise WorkflowChanged(workflow_id)

        batch.call("HGET", self._key(tenant), workflow_id, then=confirmed)

    async def put(self, tenant: str, workflow_id: str, body: Any) -> tuple[Workflow, bool]:
        """Validate and store; returns the workflow and whether it was created."""
        if isinstance(body, dict) and "id" not in body:
            body = {**body, "id": workflow_id}
        # Off the event loop: checking a tenant's templates costs what their shape costs
        # (5,000 chained attributes: ~0.25 s), and every tenant's requests wait on the loop.
        async with self._checking.entered(tenant):
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
        created = await self._counted(tenant, workflow_id, raw)
        self._remember(tenant, workflow_id, StoredWorkflow(workflow, "api", raw))
        return workflow, bool(created) and workflow_id not in self._files

    async def _counted(self, tenant: str, workflow_id: str, raw: bytes) -> bool:
        """Store ``raw`` once its tenant's storage quota has room for it (``OverQuota``
        before anything is written); whether it is new. A store that fails puts the
        workflow's previous figure back."""
        if self._quota is None:
            with translating("store the workflow"):
                return bool(await self._redis.hset(self._key(tenant), workflow_id, raw))
        member, size = workflow_member(workflow_id), len(raw) + len(workflow_id)
        # One PUT of a workflow at a time, across replicas: two racing ones could count
        # one version and store the other (the figure and the store are two writes, in
        # two hash slots). The turn lasts at most PUT_TURN_MS, should its holder die.
        async with self._put_turn(tenant, workflow_id):
            previous = await self._quota.reserve(tenant, member, size)
            try:
                with translating("store the workflow"):
                    return bool(await self._redis.hset(self._key(tenant), workflow_id, raw))
            except BaseException:
                if previous:
                    await self._quota.record(tenant, member, previous)
                else:
                    await self._quota.forget(tenant, member)
                raise

    @contextlib.asynccontextmanager
    async def _put_turn(self, tenant: str, workflow_id: str) -> AsyncIterator[None]:
        key = f"{self._key(tenant)}:put:{workflow_id}"
        token = secrets.token_hex(8)
        backoff = Backoff(base=0.005, cap=0.1)
        deadline = time.monotonic() + PUT_TURN_MS / 1000
        with translating("wait for another PUT of the workflow"):
            while not await self._redis.set(key, token, nx=True, px=PUT_TURN_MS):
                if time.monotonic() > deadline:
                    break  # its holder died holding it: the turn ends with its time
                await backoff.wait()
        try:
            yield
        finally:
            try:
                with translating("end a PUT's turn"):
                    if await self._redis.get(key) == token.encode():
                        await self._redis.delete(key)
            except FlowcastError as exc:
                # Left, the turn ends with its time (PUT_TURN_MS).
                log.warning("could not end a PUT's turn", extra={"error": str(exc)})

    async def get(self, tenant: str, workflow_id: str) -> StoredWorkflow:
        with translating("read the workflow"):
            raw = cast(bytes | None, await self._redis.hget(self._key(tenant), workflow_id))
        stored: StoredWorkflow | None = None
        if raw is not None:
            stored = StoredWorkflow(await self._parse(raw, tenant), "api", raw)
        elif workflow_id in self._files:
            stored = StoredWorkflow(self._files[workflow_id], "file")
        self._remember(tenant, workflow_id, stored)
        if stored is None:
            raise NotFound("workflow", workflow_id)
        return stored

    async def list(self, tenant: str) -> list[StoredWorkflow]:
        with translating("list workflows"):
            stored = cast(dict[bytes, bytes], await self._redis.hgetall(self._key(tenant)))
        found: dict[str, StoredWorkflow] = {
            workflow_id: StoredWorkflow(workflow, "file")
            for workflow_id, workflow in self._files.items()
        }
        for raw_id, raw in stored.items():
            try:
                found[raw_id.decode()] = StoredWorkflow(await self._parse(raw, tenant), "api", raw)
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
        self._remember(tenant, workflow_id, None)
        if self._quota is not None:
            # Also when nothing was stored: a figure a killed PUT left behind goes.
            await self._quota.forget(tenant, workflow_member(workflow_id))
        if removed:
            return
        if workflow_id in self._files:
            raise Conflict(
                "workflow_from_file",
                f"workflow {workflow_id!r} is loaded from a file; remove the file instead",
            )
        raise NotFound("workflow", workflow_id)
