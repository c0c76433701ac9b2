"""What a workflow may use (block types with plugins, ``llm`` providers) and the
workflows read from FLOWCAST_WORKFLOWS_DIR, loaded in the lifespan (and read again when
they change, in the embedded default: ``app/workflow_files.py``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from app.settings import Settings
from lib.workflows.blocks import BlockTypes
from lib.workflows.model import Workflow
from lib.workflows.plugins import load_plugins
from lib.workflows.providers import Provider, parse_providers, unknown_providers
from lib.workflows.store import Validate, load_directory
from lib.workflows.templates import Templates
from lib.workflows.validation import validate_workflow

log = logging.getLogger("flowcast")


@dataclass(frozen=True)
class Catalog:
    """What a workflow may use, and the workflows read from FLOWCAST_WORKFLOWS_DIR."""

    block_types: BlockTypes
    llm_providers: dict[str, Provider]
    validate: Validate
    files: dict[str, Workflow]


def load_catalog(settings: Settings) -> Catalog:
    """The block types (with plugins), the ``llm`` providers, and the workflow files."""
    llm_providers = parse_providers(
        settings.llm_providers, settings.llm_base_url, settings.llm_api_key
    )
    block_types = BlockTypes.builtin(load_plugins(settings.plugin_modules))
    # Validation only parses templates (no optimizer folds constants): in-process.
    templates = Templates(
        max_output_bytes=settings.template_max_bytes,
        max_render_seconds=settings.template_timeout_ms / 1000,
    )
    validate: Any = functools.partial(
        validate_workflow, block_types=block_types, templates=templates
    )
    return Catalog(
        block_types=block_types,
        llm_providers=llm_providers,
        validate=validate,
        files=read_workflow_files(settings, validate, llm_providers),
    )


def read_workflow_files(
    settings: Settings, validate: Validate, llm_providers: dict[str, Provider]
) -> dict[str, Workflow]:
    """The workflows in FLOWCAST_WORKFLOWS_DIR, each problem logged (at start, and again
    whenever the embedded default sees the files change: ``app/workflow_files.py``)."""
    files = _workflow_files(settings, validate)
    for workflow in files.values():
        for missing in unknown_providers(workflow, llm_providers):
            # Loaded all the same: executing it answers 422 with this message.
            log.warning(
                "workflow needs an llm provider",
                extra={"workflowId": workflow.id, "error": missing.message},
            )
    return files


def _workflow_files(settings: Settings, validate: Validate) -> dict[str, Workflow]:
    """The workflows in FLOWCAST_WORKFLOWS_DIR, saying where they came from: both default
    directories are relative to the working directory, so a server started elsewhere
    would otherwise come up silently with none."""
    directory = settings.workflows_dir.resolve()
    if not directory.is_dir():
        # An explicit setting was checked when the settings were built; this is the
        # default, examples/, which a server started outside the checkout lacks.
        log.warning(
            "no workflows loaded: FLOWCAST_WORKFLOWS_DIR is not set and its default, "
            "examples/ under the working directory, does not exist; set "
            "FLOWCAST_WORKFLOWS_DIR to load workflow files",
            extra={"count": 0, "dir": str(directory)},
        )
        return {}
    files, problems = load_directory(directory, validate)
    for problem in problems:
        log.error(
            "workflow file skipped", extra={"file": str(problem.path), "error": problem.message}
        )
    log.info(
        "workflows loaded from FLOWCAST_WORKFLOWS_DIR",
        extra={"count": len(files), "dir": str(directory)},
    )
    return files
