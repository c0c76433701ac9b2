"""What the routes need, built once in the lifespan and reached through the request.

The lifespan (``app/main.py``) builds it in steps, each a function here that opens its
resources on the lifespan's exit stack, so they close in reverse order when the server
stops: :func:`open_stores` (the embedded engine, the Redis clients, the buffer and the
value store with its sweeper), :func:`load_catalog` (block types, providers and the
workflow files), :func:`open_executor` (the HTTP clients, the ``llm`` slots, secrets and
the template workers behind the executor), :func:`start_runtime` (the hub of live channels and
the readers that follow the buffer, the runner, whose exit is the drain on shutdown, and
the open SSE streams) and
:func:`build_services`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from redis.asyncio import Redis

from app import logs
from app.auth import ApiKeys, Caller, authenticate, authenticate_list, authenticate_reader
from app.connections import connect
from app.embedded import EmbeddedValkey
from app.idempotency import Idempotency
from app.limits import StreamSlots
from app.node import Node, claim_node
from app.settings import Settings
from app.sse import OpenStreams
from app.tokens import StreamTokens, load_secret
from lib.execution.admission import Admission
from lib.execution.buffer import EventBuffer
from lib.execution.control import ControlStreams
from lib.execution.hub import Hub
from lib.execution.offload import OffloadPolicy
from lib.execution.ownership import Ownership
from lib.execution.retention import Sweeper
from lib.execution.store import StoreIdentity
from lib.execution.stream import Readers
from lib.execution.values import LocalValueStore, ValueStore
from lib.execution.watchlists import WatchLists
from lib.metrics import Metrics
from lib.workflows.blocks import BlockTypes
from lib.workflows.blocks.base import BlockServices
from lib.workflows.executor import Executor
from lib.workflows.finals import Finals
from lib.workflows.janitor import Janitor
from lib.workflows.launcher import Launcher
from lib.workflows.leases import LeaseKeeper, LocalRuns
from lib.workflows.listener import ControlListener
from lib.workflows.model import Workflow
from lib.workflows.plugins import load_plugins
from lib.workflows.pool import TemplatePool
from lib.workflows.providers import Provider, Providers, parse_providers, unknown_providers
from lib.workflows.runner import Runner
from lib.workflows.runstate import RunStates
from lib.workflows.secrets import SecretStore
from lib.workflows.slots import Slots
from lib.workflows.store import Validate, WorkflowStore, load_directory
from lib.workflows.takeovers import Takeovers
from lib.workflows.templates import Templates
from lib.workflows.validation import validate_workflow

log = logging.getLogger("flowcast")

TAIL_BLOCK_MS = 5_000
# Blocking reads only: the readers' notify subscription, the control streams, and a
# provider's freed-slot reader while a call waits.
MAX_TAIL_CONNECTIONS = 64


@dataclass(frozen=True)
class Services:
    settings: Settings
    buffer: EventBuffer
    hub: Hub
    readers: Readers
    runner: Runner
    workflows: WorkflowStore
    tokens: StreamTokens
    values: ValueStore
    idempotency: Idempotency
    metrics: Metrics
    keys: ApiKeys
    streams: StreamSlots
    open_streams: OpenStreams
    secrets: SecretStore
    providers: Providers


# The dependencies are ``async`` so FastAPI calls them on the loop: a plain ``def`` one
# is run in a worker thread on every request.


async def services(request: Request) -> Services:
    """The process's services (a FastAPI dependency)."""
    found: Services = request.app.state.services
    return found


async def tenant(request: Request) -> str:
    """The caller's tenant (a FastAPI dependency); ``default`` until API keys are set."""
    svc: Services = request.app.state.services
    return authenticate(request, svc.keys)


async def reader(request: Request, execution_id: str) -> Caller:
    """The caller of a stream or values route: an API key or a stream token."""
    svc: Services = request.app.state.services
    return authenticate_reader(request, svc.keys, svc.tokens, execution_id)


async def lister(request: Request) -> str:
    """The caller's tenant on the live list: an API key or a list token."""
    svc: Services = request.app.state.services
    return authenticate_list(request, svc.keys, svc.tokens)


# ---------------------------------------------------------------- built in steps


@dataclass(frozen=True)
class Stores:
    """Where executions live: Redis (two pools), the event buffer, the value store."""

    redis: Redis
    tail_redis: Redis
    buffer: EventBuffer
    values: ValueStore
    node: Node  # this process's node, and the earlier ones it proved dead


@dataclass(frozen=True)
class Catalog:
    """What a workflow may use, and the workflows read from FLOWCAST_WORKFLOWS_DIR."""

    block_types: BlockTypes
    llm_providers: dict[str, Provider]
    validate: Validate
    files: dict[str, Workflow]


@dataclass(frozen=True)
class Blocks:
    """The executor and what its blocks reach: model providers and secrets."""

    executor: Executor
    providers: Providers
    secrets: SecretStore
    secret_key: bytes


@dataclass(frozen=True)
class Runtime:
    """What runs for the process's life: the hub and the readers, the runner and the open
    SSE streams."""

    metrics: Metrics
    hub: Hub
    readers: Readers
    runner: Runner
    open_streams: OpenStreams


async def open_stores(stack: AsyncExitStack, settings: Settings) -> Stores:
    """The embedded engine (without FLOWCAST_REDIS_URL), the Redis clients, the buffer,
    and the value store with its sweeper."""
    if _data_dir_in_use(settings):
        log.info(
            "data directory (FLOWCAST_DATA_DIR)",
            extra={"dir": str(settings.data_dir.resolve())},
        )
    # Held until the process exits: the proof, for the next process on this data
    # directory, that this one is dead (its runs are then taken over at once).
    node = claim_node(settings.data_dir)
    stack.callback(node.close)
    redis_url = settings.redis_url
    if redis_url is None:
        if not node.held:
            # Two engines on one AOF would be two stores of the same executions, whose
            # owners never fence each other: refuse, rather than run each run twice.
            message = (
                "another Flowcast process runs the embedded engine in this data directory "
                "(FLOWCAST_DATA_DIR): give this one a data directory of its own, or point "
                "every process at one Redis with FLOWCAST_REDIS_URL"
            )
            log.error(message, extra={"dir": str(settings.data_dir.resolve())})
            raise RuntimeError(message)
        engine = EmbeddedValkey(data_dir=settings.data_dir / "valkey")
        await stack.enter_async_context(engine)
        redis_url = engine.url
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
    return Stores(redis=redis, tail_redis=tail_redis, buffer=buffer, values=values, node=node)


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
    files = _workflow_files(settings, validate)
    for workflow in files.values():
        for missing in unknown_providers(workflow, llm_providers):
            # Loaded all the same: executing it answers 422 with this message.
            log.warning(
                "workflow needs an llm provider",
                extra={"workflowId": workflow.id, "error": missing.message},
            )
    return Catalog(
        block_types=block_types, llm_providers=llm_providers, validate=validate, files=files
    )


async def open_executor(
    stack: AsyncExitStack, settings: Settings, stores: Stores, catalog: Catalog
) -> Blocks:
    """The executor with its HTTP clients, ``llm`` slots, secrets and template workers."""
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
        redis=stores.redis,
        tail_redis=stores.tail_redis,
        prefix=settings.redis_prefix,
        lease_seconds=settings.lease_seconds,
    )
    stack.push_async_callback(slots.close)
    await slots.introduce(catalog.llm_providers)
    providers = Providers(catalog.llm_providers, http=llm_http, slots=slots)
    secret_key = load_secret(settings.secret_key, settings.data_dir)
    secrets = SecretStore(redis=stores.redis, key=secret_key, prefix=settings.redis_prefix)
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
        catalog.block_types,
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
    return Blocks(executor=executor, providers=providers, secrets=secrets, secret_key=secret_key)


async def start_runtime(
    stack: AsyncExitStack, settings: Settings, stores: Stores, blocks: Blocks
) -> Runtime:
    """The hub, the readers, the runner and the open SSE streams; leaving the stack ends
    the streams first, then drains the runner (its exit hands off or finishes the
    executions)."""
    metrics = Metrics()
    node = stores.node
    # Idle tails look for an execution the store lost about once a lease.
    tail_block_ms = min(TAIL_BLOCK_MS, max(100, int(settings.lease_seconds * 1000)))
    hub = Hub()
    readers = await stack.enter_async_context(
        Readers(
            buffer=stores.buffer,
            hub=hub,
            tail_block_ms=tail_block_ms,
            gone_seconds=settings.lease_seconds,
            cutoff_seconds=settings.lease_seconds,
            metrics=metrics,
        )
    )
    runner = await stack.enter_async_context(
        build_runner(settings, stores, blocks, hub=hub, metrics=metrics, node=node)
    )
    open_streams = await stack.enter_async_context(
        OpenStreams(ping_seconds=settings.sse_ping_seconds, max_seconds=settings.sse_max_seconds)
    )
    metrics.watch(
        pending=runner.pending_events,
        sse_clients=open_streams.__len__,  # execution streams and live lists alike
        bytes_retained=runner.retained_bytes,
    )
    return Runtime(
        metrics=metrics, hub=hub, readers=readers, runner=runner, open_streams=open_streams
    )


def offload_policy(settings: Settings) -> OffloadPolicy:
    """When event values go to the value store (SPEC §5)."""
    return OffloadPolicy(
        large_value_bytes=settings.large_value_bytes,
        budget_bytes=settings.event_budget_bytes,
        event_limit=settings.event_limit,
        inline_file_bytes=settings.inline_file_bytes,
    )


def build_runner(
    settings: Settings, stores: Stores, blocks: Blocks, *, hub: Hub, metrics: Metrics, node: Node
) -> Runner:
    """The runner and its parts, each built once for the process: the ownership state
    machine and what it keeps in step, the run states, and the parts that share the
    executions running here.

    Longer than most: one flat construction per part, in the order they depend on each
    other; cut in two, the parts would travel through as many parameters again."""
    buffer, lease = stores.buffer, settings.lease_seconds
    watch = WatchLists(buffer=buffer, lease_seconds=lease)
    limit = settings.max_executions_per_tenant
    admission = Admission(buffer=buffer, lease_seconds=lease, limit=limit)
    control = ControlStreams(buffer=buffer)
    store = StoreIdentity(buffer=buffer, lease_seconds=lease)
    ownership = Ownership(
        buffer=buffer, lease_seconds=lease, watch=watch, admission=admission, control=control
    )
    states = RunStates(buffer=buffer, values=stores.values)
    finals = Finals(buffer=buffer, watch=watch, admission=admission, states=states)
    runs = LocalRuns()
    launcher = Launcher(
        buffer=buffer,
        hub=hub,
        executor=blocks.executor,
        values=stores.values,
        ownership=ownership,
        watch=watch,
        admission=admission,
        states=states,
        finals=finals,
        runs=runs,
        accepting=lambda: runs.accepting,
        offload=offload_policy(settings),
        max_pending_events=settings.max_pending_events,
        lease_seconds=lease,
        metrics=metrics,
    )
    takeovers = Takeovers(
        buffer=buffer,
        ownership=ownership,
        watch=watch,
        admission=admission,
        store=store,
        states=states,
        launcher=launcher,
        runs=runs,
        node_id=node.id,
        max_recoveries=settings.max_recoveries,
    )
    return Runner(
        buffer=buffer,
        ownership=ownership,
        watch=watch,
        admission=admission,
        control=control,
        store=store,
        states=states,
        finals=finals,
        runs=runs,
        launcher=launcher,
        keeper=LeaseKeeper(ownership=ownership, lease_seconds=lease, runs=runs),
        listener=ControlListener(control=control, node_id=node.id, runs=runs),
        janitor=Janitor(store=store, watch=watch, lease_seconds=lease, dead_nodes=node.dead),
        takeovers=takeovers,
        node_id=node.id,
        shutdown_grace_seconds=settings.shutdown_grace_seconds,
    )


def build_services(
    settings: Settings, stores: Stores, catalog: Catalog, blocks: Blocks, runtime: Runtime
) -> Services:
    """What the routes reach, from the parts the steps above opened."""
    return Services(
        settings=settings,
        buffer=stores.buffer,
        hub=runtime.hub,
        readers=runtime.readers,
        runner=runtime.runner,
        workflows=WorkflowStore(
            redis=stores.redis,
            validate=catalog.validate,
            files=catalog.files,
            prefix=settings.redis_prefix,
            admit=blocks.providers.problems,
        ),
        tokens=StreamTokens(
            secret=blocks.secret_key, lifetime_seconds=settings.stream_token_seconds
        ),
        secrets=blocks.secrets,
        providers=blocks.providers,
        values=stores.values,
        metrics=runtime.metrics,
        keys=ApiKeys(settings.api_keys),
        streams=StreamSlots(settings.max_streams_per_tenant),
        open_streams=runtime.open_streams,
        idempotency=Idempotency(
            redis=stores.redis,
            prefix=settings.redis_prefix,
            ttl_seconds=settings.idempotency_seconds,
            retention_seconds=settings.retention_seconds,
        ),
    )


def warn_about_defaults(settings: Settings) -> None:
    """Say which unsafe or single-process defaults are in use."""
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
