"""What the routes need, built once in the lifespan and reached through the request.

The lifespan (``app/main.py``) opens the parts in steps, each in a module of its own that
opens its resources on the lifespan's exit stack, so they close in reverse order when
the server stops: the stores (``app/stores.py``), the workflow catalog
(``app/catalog.py``), the executor (``app/executor.py``) and the runtime
(``app/runtime.py``: the hub, the readers, the runner with its parts and the open SSE
streams). :func:`build_services` then gathers what the routes reach, and the FastAPI
dependencies below hand it (or the caller it authenticates) to each route.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from app.auth import ApiKeys, Caller, authenticate, authenticate_list, authenticate_reader
from app.catalog import Catalog
from app.executor import Blocks
from app.idempotency import Idempotency
from app.limits import StreamSlots
from app.runtime import Runtime
from app.settings import Settings
from app.sse import OpenStreams
from app.stores import Stores
from app.tokens import ListGrant, StreamTokens
from lib.execution.buffer import EventBuffer
from lib.execution.hub import Hub
from lib.execution.stream import Readers
from lib.execution.values import ValueStore
from lib.metrics import Metrics
from lib.tenancy import CURRENT_TENANT
from lib.webhooks.outbox import Outbox
from lib.webhooks.signing import WebhookSecrets
from lib.webhooks.spec import address_problems
from lib.workflows.providers import Providers
from lib.workflows.runner import Runner
from lib.workflows.secrets import SecretStore
from lib.workflows.store import WorkflowStore


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
    outbox: Outbox
    webhook_secrets: WebhookSecrets


# The dependencies are ``async`` so FastAPI calls them on the loop: a plain ``def`` one
# is run in a worker thread on every request.


async def services(request: Request) -> Services:
    """The process's services (a FastAPI dependency)."""
    found: Services = request.app.state.services
    return found


async def tenant(request: Request) -> str:
    """The caller's tenant (a FastAPI dependency); ``default`` until API keys are set."""
    svc: Services = request.app.state.services
    caller = authenticate(request, svc.keys)
    CURRENT_TENANT.set(caller)  # whose request: its log lines are masked with its secrets
    return caller


async def reader(request: Request, execution_id: str) -> Caller:
    """The caller of a stream or values route: an API key or a stream token."""
    svc: Services = request.app.state.services
    caller = authenticate_reader(request, svc.keys, svc.tokens, execution_id)
    CURRENT_TENANT.set(caller.tenant)
    return caller


async def lister(request: Request) -> ListGrant:
    """The caller of the live list: an API key or a list token (and until when)."""
    svc: Services = request.app.state.services
    grant = authenticate_list(request, svc.keys, svc.tokens)
    CURRENT_TENANT.set(grant.tenant)
    return grant


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
            admit=lambda workflow: [
                *blocks.providers.problems(workflow),
                *address_problems(
                    workflow.webhooks or [],
                    "$.webhooks",
                    allow_private=settings.http_allow_private,
                ),
            ],
            quota=stores.quota,
        ),
        tokens=StreamTokens(
            secret=blocks.secret_key, lifetime_seconds=settings.stream_token_seconds
        ),
        secrets=blocks.secrets,
        providers=blocks.providers,
        outbox=runtime.outbox,
        webhook_secrets=runtime.webhook_secrets,
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
