"""What the routes need, built once in the lifespan and reached through the request."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from app.auth import ApiKeys, Caller, authenticate, authenticate_list, authenticate_reader
from app.idempotency import Idempotency
from app.limits import StreamSlots
from app.settings import Settings
from app.sse import OpenStreams
from app.tokens import StreamTokens
from lib.execution.buffer import EventBuffer
from lib.execution.hub import Hub
from lib.execution.values import ValueStore
from lib.metrics import Metrics
from lib.workflows.providers import Providers
from lib.workflows.runner import Runner
from lib.workflows.secrets import SecretStore
from lib.workflows.store import WorkflowStore


@dataclass(frozen=True)
class Services:
    settings: Settings
    buffer: EventBuffer
    hub: Hub
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
