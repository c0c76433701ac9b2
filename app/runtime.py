"""What runs for the process's life, started last in the lifespan: the hub of live
channels and the readers that follow the buffer, the runner with its parts (built once
here, in ``build_runner``), and the open SSE streams. Leaving the lifespan's stack ends
the streams first, then drains the runner."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass

from app.auth import tenant_of_key
from app.executor import Blocks
from app.loopwatch import LoopWatch
from app.node import Node
from app.settings import Settings
from app.sse import OpenStreams
from app.stores import TAIL_BLOCK_MS, Stores
from lib.execution.blame import NodeRecords, Suspicion
from lib.execution.hub import Hub
from lib.execution.offload import OffloadPolicy
from lib.execution.stream import Readers
from lib.metrics import Metrics
from lib.webhooks.deliver import Deliverer
from lib.webhooks.outbox import Outbox, OutboxKeys
from lib.webhooks.signing import WebhookSecrets
from lib.workflows.finals import Finals
from lib.workflows.janitor import Janitor
from lib.workflows.launcher import Launcher
from lib.workflows.leases import LeaseKeeper, LocalRuns
from lib.workflows.listener import ControlListener
from lib.workflows.parts import Parts, Transitions
from lib.workflows.runner import Runner
from lib.workflows.runstate import RunStates
from lib.workflows.schemas import SchemaChecks
from lib.workflows.takeovers import Takeovers


@dataclass(frozen=True)
class Runtime:
    """What runs for the process's life: the hub and the readers, the runner and the open
    SSE streams."""

    metrics: Metrics
    hub: Hub
    readers: Readers
    runner: Runner
    open_streams: OpenStreams
    outbox: Outbox
    webhook_secrets: WebhookSecrets


async def start_runtime(
    stack: AsyncExitStack, settings: Settings, stores: Stores, blocks: Blocks
) -> Runtime:
    """The hub, the readers, the runner and the open SSE streams; leaving the stack ends
    the streams first, then drains the runner (its exit hands off or finishes the
    executions)."""
    metrics = Metrics()
    await stack.enter_async_context(LoopWatch(metrics, settings.loop_watch_ms / 1000))
    node = stores.node
    # Idle tails look for an execution the store lost about once a lease.
    tail_block_ms = min(TAIL_BLOCK_MS, max(100, int(settings.lease_seconds * 1000)))
    hub = Hub()
    # A hint written anywhere wakes this process's webhook deliverer, if it has one.
    webhook_wake = asyncio.Event()
    delivers = settings.worker_slots > 0
    readers = await stack.enter_async_context(
        Readers(
            buffer=stores.buffer,
            hub=hub,
            tail_block_ms=tail_block_ms,
            gone_seconds=settings.lease_seconds,
            cutoff_seconds=settings.lease_seconds,
            metrics=metrics,
            wakes={OutboxKeys(settings.redis_prefix).wake: webhook_wake} if delivers else None,
        )
    )
    runner = await stack.enter_async_context(
        build_runner(settings, stores, blocks, hub=hub, metrics=metrics, node=node)
    )
    readers.place = runner.dispatcher.ahead  # a queued execution's stream tells its place
    open_streams = await stack.enter_async_context(
        OpenStreams(ping_seconds=settings.sse_ping_seconds, max_seconds=settings.sse_max_seconds)
    )
    metrics.watch(
        pending=runner.pending_events,
        sse_clients=open_streams.__len__,  # execution streams and live lists alike
        bytes_retained=runner.retained_bytes,
    )
    metrics.watch_queue(
        backlog=runner.dispatcher.backlog,
        slots=runner.dispatcher.slots,
        used=runner.running_here,
    )
    outbox, webhook_secrets = await start_webhooks(
        stack, settings, stores, blocks, metrics, wake=webhook_wake
    )
    return Runtime(
        metrics=metrics,
        hub=hub,
        readers=readers,
        runner=runner,
        open_streams=open_streams,
        outbox=outbox,
        webhook_secrets=webhook_secrets,
    )


async def start_webhooks(
    stack: AsyncExitStack,
    settings: Settings,
    stores: Stores,
    blocks: Blocks,
    metrics: Metrics,
    *,
    wake: asyncio.Event,
) -> tuple[Outbox, WebhookSecrets]:
    """The webhook outbox and secrets; a process that runs work also delivers (its own
    tasks and client, never a worker slot), woken by ``wake`` (set by its tails)."""
    redis, prefix = stores.buffer.redis, settings.redis_prefix
    retries = settings.webhook_retries
    keep = settings.retention_seconds + int(sum(retries)) + 3600
    outbox = Outbox(redis=redis, prefix=prefix, keep_seconds=keep)
    secrets = WebhookSecrets(redis=redis, key=blocks.secret_key, prefix=prefix)
    metrics.watch_webhooks(outbox.oldest_pending_ms)
    if settings.worker_slots > 0:
        await stack.enter_async_context(
            Deliverer(
                redis=redis,
                outbox=outbox,
                secrets=secrets,
                retry_seconds=retries,
                allow_private=settings.http_allow_private,
                concurrency=settings.webhook_concurrency,
                timeout_seconds=settings.webhook_timeout_seconds,
                metrics=metrics,
                prefix=prefix,
                wake=wake,
            )
        )
    return outbox, secrets


def tenant_weights(settings: Settings) -> dict[str, float]:
    """``FLOWCAST_TENANT_WEIGHTS`` by tenant: a name that is one of ``FLOWCAST_API_KEYS``
    stands for that key's tenant (an operator knows keys, not their hashes); any other
    name is a tenant as it is (``t_…``, or ``default`` without keys)."""
    keys = {key.strip() for key in (settings.api_keys or "").split(",") if key.strip()}
    return {
        tenant_of_key(name) if name in keys else name: weight
        for name, weight in settings.weights.items()
    }


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
    """The runner and its parts, each built once for the process: the ``Parts`` the
    runner shares with the takeovers (the ownership state machine and what it keeps in
    step, the run states, the endings, the executions running here and their launcher),
    then the loops that act on those executions."""
    buffer, lease = stores.buffer, settings.lease_seconds
    transitions = Transitions.build(
        buffer,
        lease_seconds=lease,
        limit=settings.max_executions_per_tenant,
        running=settings.max_running_per_tenant,
        weights=tenant_weights(settings),
    )
    states = RunStates(buffer=buffer, values=stores.values)
    finals = Finals(
        buffer=buffer,
        watch=transitions.watch,
        admission=transitions.admission,
        states=states,
        lease_seconds=lease,
    )
    runs = LocalRuns()
    launcher = Launcher(
        buffer=buffer,
        hub=hub,
        executor=blocks.executor,
        values=stores.values,
        ownership=transitions.ownership,
        watch=transitions.watch,
        admission=transitions.admission,
        states=states,
        finals=finals,
        runs=runs,
        accepting=lambda: runs.accepting,
        offload=offload_policy(settings),
        max_pending_events=settings.max_pending_events,
        lease_seconds=lease,
        metrics=metrics,
    )
    parts = Parts(buffer, transitions, states, finals, runs, launcher, node_id=node.id)
    suspicion = Suspicion(
        records=NodeRecords(redis=buffer.redis, keys=buffer.keys),
        node_id=node.id,
        runs=runs,
        refresh_seconds=lease / 3,
        probation_seconds=lease,
    )
    return Runner(
        parts,
        keeper=LeaseKeeper(
            ownership=transitions.ownership, lease_seconds=lease, runs=runs, suspicion=suspicion
        ),
        listener=ControlListener(control=transitions.control, node_id=node.id, runs=runs),
        janitor=Janitor(
            store=transitions.store,
            watch=transitions.watch,
            lease_seconds=lease,
            dead_nodes=node.dead,
        ),
        takeovers=Takeovers(parts, max_recoveries=settings.max_recoveries, suspicion=suspicion),
        shutdown_grace_seconds=settings.shutdown_grace_seconds,
        worker_slots=settings.worker_slots,
        metrics=metrics,
        schemas=SchemaChecks(cpu_seconds=settings.template_timeout_ms / 1000),
    )
