"""Traces (SPEC §15): what the rest of Flowcast calls, and nothing when tracing is off.

Tracing is on only when the standard OpenTelemetry variables ask for it (``requested``);
then ``lib/otel.py`` (the only module that imports the OpenTelemetry SDK) is loaded by
``start`` and every call here goes to it. Off, none of the SDK, the instrumentation or
the exporter is imported (the API alone is FastAPI's own dependency, and FastAPI's
native telemetry stays off while no tracer provider is set), and each call here is one
test of a module global.

An execution may run in several processes (a worker takes it from the queue, another
recovers it after its owner died, a resume runs on another replica), yet it is one
trace: its trace id and the id of its execution span are drawn when it is accepted
(``new_trace``) and kept in its record (``Field.TRACE``, as ``trace``), so every process
parents its block spans to that span, and whoever stores its terminal event exports
the execution span itself, from ``createdAt``, with that id (``end_execution``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lib.otel import Otel

log = logging.getLogger(__name__)

# The SDK side once ``start`` ran; None: tracing is off.
_otel: Otel | None = None


def requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the standard variables ask for traces: an OTLP endpoint (for traces or
    all signals) or a traces exporter named, unless the SDK is disabled or the exporter
    is ``none``."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoints = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(exporter) or any(env.get(name, "").strip() for name in endpoints)


def start(*, redis: bool = False) -> Otel | None:
    """Turn tracing on for this process if the variables ask for it (once); ``redis``:
    a span per Redis command too."""
    global _otel
    if _otel is None and requested():
        from lib.otel import Otel  # only when asked: off costs nothing

        _otel = Otel.from_env(redis=redis)
    return _otel


def flush() -> None:
    """Export what is pending (an app's lifespan ends; the SDK exports the rest at exit)."""
    if _otel is not None:
        _otel.provider.force_flush()


def enabled() -> bool:
    return _otel is not None


def new_trace() -> str | None:
    """The trace of an execution accepted now (None when off): a child of the current
    span (the request's, itself a child of an incoming ``traceparent``) or a new root."""
    if _otel is None:
        return None
    try:
        return _otel.new_trace()
    except Exception:  # a trace is never worth a refused start
        log.warning("could not draw the execution's trace; it runs untraced", exc_info=True)
        return None


@contextlib.contextmanager
def execution_context(trace: str | None) -> Iterator[None]:
    """Within: spans (block attempts, outbound calls) are children of the execution's;
    none at all for an execution accepted untraced (``trace`` empty)."""
    if _otel is None:
        yield
        return
    with _otel.execution_context(trace or ""):
        yield


class BlockSpan:
    """What a block attempt tells its span (nothing when off)."""

    __slots__ = ()

    def outcome(self, outcome: str, error_code: str | None = None) -> None:
        pass


_NO_SPAN = BlockSpan()


@contextlib.contextmanager
def block_span(
    execution_id: str, block_id: str, block_type: str, attempt: int
) -> Iterator[BlockSpan]:
    """One block attempt's span, a child of the execution's (when tracing is on)."""
    if _otel is None:
        yield _NO_SPAN
        return
    with _otel.block_span(execution_id, block_id, block_type, attempt) as span:
        yield span


def end_execution(identity: Mapping[str, str], execution_id: str, status: str, ts: str) -> None:
    """Export the execution's span, ended at ``ts`` with ``status`` (by the process
    that stored its terminal event)."""
    if _otel is None:
        return
    try:
        _otel.end_execution(identity, execution_id, status, ts)
    except Exception:  # nor an execution's end held up by its span
        log.warning(
            "could not export the execution's span",
            exc_info=True,
            extra={"executionId": execution_id},
        )
