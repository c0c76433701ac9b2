"""The app factories: ``uvicorn --factory app.main:create_app`` (the API, which runs work
too unless ``FLOWCAST_WORKER_SLOTS=0``) and ``app.main:create_worker`` (``flowcast
worker``: the same process without the API, SPEC §14).

Nothing is built at import time. ``create_app`` reads the settings; the lifespan opens
every resource in steps, one module each (the stores, the workflow catalog, the
executor, and the runtime: the hub and the runner with the open streams), gathers what
the routes reach (``app/services.py``), and closes them in reverse order.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI

from app import errors, logs, memory, tracing
from app.auth import ApiKeys, Callers, KeysFirst, LoopbackOnly
from app.catalog import load_catalog
from app.executor import open_executor
from app.limits import BodyLimit, Turns
from app.routes import (
    executions,
    health,
    live,
    page,
    secrets,
    streams,
    values,
    webhooks,
    workflows,
)
from app.runtime import start_runtime
from app.services import build_services
from app.settings import NO_SLOTS, Settings, warn_about_defaults
from app.stores import open_stores
from app.workflow_files import WorkflowFilesWatch

log = logging.getLogger("flowcast")


def create_app(settings: Settings | None = None, *, api: bool = True) -> FastAPI:
    """Build the Flowcast app; resources open when the app's lifespan starts.

    ``api=False`` builds a worker: the same lifespan (the runner takes queued work for
    its slots, drains and hands off on SIGTERM), with only ``/healthz``, ``/readyz`` and
    ``/metrics`` mounted; every other path is 404."""
    settings = settings or Settings()
    logs.configure(settings.log_level, settings.log_format)
    memory.pin_mmap_threshold()
    # `kill -USR1 <pid>` writes every thread's stack to stderr: where a process that
    # does not stop (or answer) is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    app = FastAPI(
        title="Flowcast",
        version="0.1.0",
        summary="Workflow executions with a durable, resumable event stream.",
        lifespan=functools.partial(_lifespan, settings=settings),
        # A worker documents no API: it has none.
        openapi_url="/openapi.json" if api else None,
    )
    errors.install(app)
    tracing.install(app, redis=settings.traces_redis)
    # Innermost: a request waits its turn once its headers were checked and its body
    # arrived (app/limits.py Turns).
    app.add_middleware(Turns, caller=Callers(ApiKeys(settings.api_keys)))
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        timeout_seconds=settings.body_timeout_seconds,
    )
    if settings.api_keys:
        app.add_middleware(KeysFirst, keys=ApiKeys(settings.api_keys))
    else:
        app.add_middleware(LoopbackOnly)
    # live before executions: /api/executions/{eid} would take "live" for an id.
    routers = (health, workflows, live, executions, streams, values, secrets, webhooks, page)
    for module in routers if api else (health,):
        app.include_router(module.router)
    return app


def create_worker(settings: Settings | None = None) -> FastAPI:
    """A process that only runs work (``flowcast worker``): health and metrics, no API."""
    settings = settings or Settings()
    if settings.worker_slots == 0:
        raise ValueError(NO_SLOTS)
    app = create_app(settings, api=False)
    log.info(
        "worker: runs queued executions, serves /healthz, /readyz and /metrics only",
        extra={"slots": settings.worker_slots},
    )
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI, *, settings: Settings) -> AsyncIterator[None]:
    # Each step opens its resources on the stack: they close in reverse order, so on
    # shutdown the streams end first, then the runner drains, then the clients close.
    async with AsyncExitStack() as stack:
        tracing.flush_on_close(stack)
        stores = await open_stores(stack, settings)
        catalog = load_catalog(settings)
        blocks = await open_executor(stack, settings, stores, catalog)
        runtime = await start_runtime(stack, settings, stores, blocks)
        app.state.services = build_services(settings, stores, catalog, blocks, runtime)
        await stack.enter_async_context(
            WorkflowFilesWatch(settings, catalog, app.state.services.workflows)
        )
        warn_about_defaults(settings)
        memory.settle_gc()
        yield
