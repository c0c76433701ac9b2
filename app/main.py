"""The app factory: ``uvicorn --factory app.main:create_app``.

Nothing is built at import time. ``create_app`` reads the settings; the lifespan opens
every resource (the embedded engine when no Redis URL is set, the Redis client, the HTTP
client for ``http`` blocks, the template worker pool, the hub and the runner) and closes
them in reverse order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from app import errors, logs, memory
from app.auth import ApiKeys, LoopbackOnly
from app.connections import connect
from app.embedded import EmbeddedValkey
from app.idempotency import Idempotency
from app.limits import BodyLimit, StreamSlots
from app.routes import executions, health, live, page, secrets, streams, values, workflows
from app.services import Services
from app.settings import Settings
from app.sse import OpenStreams
from app.tokens import StreamTokens, load_secret
from lib.execution.buffer import EventBuffer
from lib.execution.hub import Hub
from lib.execution.offload import OffloadPolicy
from lib.execution.ownership import Ownership
from lib.execution.retention import Sweeper
from lib.execution.values import LocalValueStore, ValueStore
from lib.metrics import Metrics
from lib.workflows.blocks import BlockTypes
from lib.workflows.blocks.base import BlockServices
from lib.workflows.executor import Executor
from lib.workflows.model import Workflow
from lib.workflows.plugins import load_plugins
from lib.workflows.pool import TemplatePool
from lib.workflows.providers import Providers, parse_providers, unknown_providers
from lib.workflows.runner import Runner
from lib.workflows.secrets import SecretStore
from lib.workflows.slots import Slots
from lib.workflows.store import Validate, WorkflowStore, load_directory
from lib.workflows.templates import Templates
from lib.workflows.validation import validate_workflow

log = logging.getLogger("flowcast")

TAIL_BLOCK_MS = 5_000
# Blocking reads only: the hub's notify subscription, the control streams, and a
# provider's freed-slot reader while a call waits.
MAX_TAIL_CONNECTIONS = 64


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the Flowcast app; resources open when the app's lifespan starts."""
    settings = settings or Settings()
    logs.configure(settings.log_level, settings.log_format)
    memory.pin_mmap_threshold()
    app = FastAPI(
        title="Flowcast",
        version="0.1.0",
        summary="Workflow executions with a durable, resumable event stream.",
        lifespan=functools.partial(_lifespan, settings=settings),
    )
    errors.install(app)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        timeout_seconds=settings.body_timeout_seconds,
    )
    if not settings.api_keys:
        app.add_middleware(LoopbackOnly)
    # live before executions: /api/executions/{eid} would take "live" for an id.
    for module in (health, workflows, live, executions, streams, values, secrets, page):
        app.include_router(module.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI, *, settings: Settings) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        if _data_dir_in_use(settings):
            log.info(
                "data directory (FLOWCAST_DATA_DIR)",
                extra={"dir": str(settings.data_dir.resolve())},
            )
        redis_url = settings.redis_url
        if redis_url is None:
            engine = EmbeddedValkey(data_dir=settings.data_dir / "valkey")
            await stack.enter_async_context(engine)
            redis_url = engine.url
        # Idle tails look for an execution the store lost about once a lease.
        tail_block_ms = min(TAIL_BLOCK_MS, max(100, int(settings.lease_seconds * 1000)))
        redis = connect(
            redis_url,
            socket_timeout=TAIL_BLOCK_MS / 1000 + 10,
            max_connections=settings.redis_max_connections,
        )
        stack.push_async_callback(redis.aclose)
        # Blocking reads hold their connection: a pool of their own, so they never
        # starve the requests of connections.
        tail_redis = connect(
            redis_url,
            socket_timeout=TAIL_BLOCK_MS / 1000 + 10,
            max_connections=MAX_TAIL_CONNECTIONS,
            wait_seconds=None,
        )
        stack.push_async_callback(tail_redis.aclose)

        buffer = EventBuffer(
            redis=redis,
            tail_redis=tail_redis,
            prefix=settings.redis_prefix,
            event_limit=settings.event_limit,
            budget_bytes=settings.event_budget_bytes,
            retention_seconds=settings.retention_seconds,
        )
        values = _value_store(settings)
        await stack.enter_async_context(
            Sweeper(store=values, buffer=buffer, interval_seconds=settings.sweep_seconds)
        )

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
        files = _workflow_files(settings, validate)
        for workflow in files.values():
            for missing in unknown_providers(workflow, llm_providers):
                # Loaded all the same: executing it answers 422 with this message.
                log.warning(
                    "workflow needs an llm provider",
                    extra={"workflowId": workflow.id, "error": missing.message},
                )

        http = httpx.AsyncClient(
            follow_redirects=False,
            limits=httpx.Limits(max_connections=settings.http_max_concurrency),
        )
        stack.push_async_callback(http.aclose)
        # Model calls stream for long: a client of their own, so they never wait for
        # (or hold) the http blocks' connections.
        llm_http = httpx.AsyncClient(follow_redirects=False)
        stack.push_async_callback(llm_http.aclose)
        slots = Slots(
            redis=redis,
            tail_redis=tail_redis,
            prefix=settings.redis_prefix,
            lease_seconds=settings.lease_seconds,
        )
        stack.push_async_callback(slots.close)
        await slots.introduce(llm_providers)
        providers = Providers(llm_providers, http=llm_http, slots=slots)
        secret_key = load_secret(settings.secret_key, settings.data_dir)
        secrets = SecretStore(redis=redis, key=secret_key, prefix=settings.redis_prefix)
        logs.mask_with(secrets.redact_text)
        stack.callback(logs.mask_with, None)
        template_pool = await stack.enter_async_context(
            TemplatePool(
                size=settings.template_workers,
                timeout_ms=settings.template_timeout_ms,
                max_output_bytes=settings.template_max_bytes,
            )
        )
        executor = Executor(
            block_types,
            BlockServices(
                http=http,
                http_allow_private=settings.http_allow_private,
                http_limiter=asyncio.Semaphore(settings.http_max_concurrency),
                templates=template_pool,
                llm=providers,
            ),
            concurrency=settings.block_concurrency,
            secrets=secrets,
        )

        metrics = Metrics()
        hub = await stack.enter_async_context(
            Hub(
                buffer=buffer,
                tail_block_ms=tail_block_ms,
                gone_seconds=settings.lease_seconds,
                metrics=metrics,
            )
        )
        runner = await stack.enter_async_context(
            Runner(
                buffer=buffer,
                hub=hub,
                executor=executor,
                values=values,
                ownership=Ownership(buffer=buffer, lease_seconds=settings.lease_seconds),
                lease_seconds=settings.lease_seconds,
                shutdown_grace_seconds=settings.shutdown_grace_seconds,
                max_executions_per_tenant=settings.max_executions_per_tenant,
                max_recoveries=settings.max_recoveries,
                metrics=metrics,
                offload=OffloadPolicy(
                    large_value_bytes=settings.large_value_bytes,
                    budget_bytes=settings.event_budget_bytes,
                    event_limit=settings.event_limit,
                    inline_file_bytes=settings.inline_file_bytes,
                ),
                max_pending_events=settings.max_pending_events,
            )
        )
        open_streams = await stack.enter_async_context(
            OpenStreams(ping_seconds=settings.sse_ping_seconds)
        )
        metrics.watch(
            pending=runner.pending_events,
            sse_clients=open_streams.__len__,  # execution streams and live lists alike
            bytes_retained=runner.retained_bytes,
        )
        app.state.services = Services(
            settings=settings,
            buffer=buffer,
            hub=hub,
            runner=runner,
            workflows=WorkflowStore(
                redis=redis,
                validate=validate,
                files=files,
                prefix=settings.redis_prefix,
                admit=providers.problems,
            ),
            tokens=StreamTokens(secret=secret_key, lifetime_seconds=settings.stream_token_seconds),
            secrets=secrets,
            providers=providers,
            values=values,
            metrics=metrics,
            keys=ApiKeys(settings.api_keys),
            streams=StreamSlots(settings.max_streams_per_tenant),
            open_streams=open_streams,
            idempotency=Idempotency(
                redis=redis,
                prefix=settings.redis_prefix,
                ttl_seconds=settings.idempotency_seconds,
                retention_seconds=settings.retention_seconds,
            ),
        )
        if not settings.api_keys:
            log.warning(
                "no FLOWCAST_API_KEYS set: the API is open, so it answers on loopback only "
                "and refuses requests relayed by a proxy"
            )
        if settings.redis_url and not settings.secret_key:
            log.warning(
                "no FLOWCAST_SECRET_KEY set: this process uses a key of its own, so stream "
                "tokens and secrets work only where it runs; give every replica the same key"
            )
        memory.settle_gc()
        yield


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


def _data_dir_in_use(settings: Settings) -> bool:
    return not settings.redis_url or not settings.s3_bucket or not settings.secret_key


def _value_store(settings: Settings) -> ValueStore:
    """S3 when a bucket is configured, else a directory under the data directory."""
    if settings.s3_bucket:
        from lib.execution.s3 import S3ValueStore  # boto3 is imported only when used

        return S3ValueStore(
            bucket=settings.s3_bucket,
            prefix=settings.s3_prefix,
            endpoint_url=settings.s3_endpoint_url,
        )
    root = settings.data_dir / "values"
    root.mkdir(parents=True, exist_ok=True)
    return LocalValueStore(root=root)
