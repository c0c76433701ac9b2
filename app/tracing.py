"""Traces of the requests this process serves (SPEC §15), when the OpenTelemetry
variables ask for them; the rest is lib/tracing.py's. Off, none of the SDK or the
instrumentation is imported."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from fastapi import FastAPI

from lib import tracing


def install(app: FastAPI, *, redis: bool = False) -> None:
    """Start tracing in this process if asked, and trace ``app``'s requests (and every
    Redis command with ``redis``)."""
    otel = tracing.start(redis=redis)
    if otel is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=otel.provider,
        # Probes and scrapes are not requests anyone follows; a stream's frames are
        # not spans (one per event would cost more than the event).
        excluded_urls="healthz,readyz,metrics",
        exclude_spans=["receive", "send"],
    )


def flush_on_close(stack: AsyncExitStack) -> None:
    """Export the spans still pending when the app's lifespan ends."""
    if tracing.enabled():
        stack.push_async_callback(asyncio.to_thread, tracing.flush)
