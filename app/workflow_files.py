"""Workflow files read again when they change, in the embedded default.

With no ``FLOWCAST_REDIS_URL`` one process serves everything, so a person editing
``examples/`` (or ``FLOWCAST_WORKFLOWS_DIR``) sees the change at the next run, without a
restart. Every ``interval`` the directory's ``*.json`` names, sizes and modification
times are compared with the last look; on any difference the whole directory is read
again as at start (a file that does not load is logged and left out, as at start) and
replaces the workflows from files. Executions already started keep the version they
started with. With Redis configured there may be several replicas, each reading its own
copy of the directory at its own moment: they read the files at start only.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import TracebackType

from app.catalog import Catalog, read_workflow_files
from app.settings import Settings
from lib import tasks
from lib.workflows.store import WorkflowStore

log = logging.getLogger("flowcast")

INTERVAL_SECONDS = 1.0
Fingerprint = frozenset[tuple[str, int, int]]


def fingerprint(directory: Path) -> Fingerprint:
    """What changes when a workflow file is added, removed or written."""
    seen: set[tuple[str, int, int]] = set()
    try:
        for path in directory.glob("*.json"):
            try:
                info = path.stat()
            except OSError:  # removed between the listing and the look
                continue
            seen.add((path.name, info.st_mtime_ns, info.st_size))
    except OSError:
        pass
    return frozenset(seen)


class WorkflowFilesWatch:
    """Reads the workflow files again when they change (embedded default only)."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        store: WorkflowStore,
        interval: float = INTERVAL_SECONDS,
    ) -> None:
        self._settings, self._catalog, self._store = settings, catalog, store
        self._interval = interval
        self._directory = settings.workflows_dir.resolve()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WorkflowFilesWatch:
        if self._settings.redis_url is None:
            # The first look right after the start's read: a change between the two is
            # seen at the next edit.
            last = await asyncio.to_thread(fingerprint, self._directory)
            self._task = asyncio.create_task(self._watch(last), name="workflow-files")
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await tasks.stop(self._task)

    async def _watch(self, last: Fingerprint) -> None:
        catalog = self._catalog
        while True:
            await asyncio.sleep(self._interval)
            now = await asyncio.to_thread(fingerprint, self._directory)
            if now == last:
                continue
            last = now
            files = await asyncio.to_thread(
                read_workflow_files, self._settings, catalog.validate, catalog.llm_providers
            )
            self._store.replace_files(files)
            log.info(
                "workflow files changed: read again",
                extra={"count": len(files), "dir": str(self._directory)},
            )
