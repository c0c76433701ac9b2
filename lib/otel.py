"""The OpenTelemetry side of traces: the only module that imports the SDK.

Loaded by ``lib.tracing.start`` when the standard variables ask for traces; the exporter
(OTLP over HTTP, or the console) and the resource read those variables themselves
(``OTEL_EXPORTER_OTLP_*``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``).

An execution's trace is kept in its record as ``"<trace id> <span id> <parent span id
or -> <flags>"`` (hex). Its span is exported once, by the process that stored its
terminal event, with the span id drawn at accept and ``createdAt`` as its start: the
provider's id generator hands out those ids for that one span (``_Ids``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import datetime

from opentelemetry import context, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.instrumentation.utils import (
    is_instrumentation_enabled,
    suppress_instrumentation,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from lib.execution.record import Field
from lib.tracing import BlockSpan

_NO_SPAN = BlockSpan()

log = logging.getLogger(__name__)

# (trace id, span id) the next span started in this context must have.
_FIXED: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "flowcast_fixed_span", default=None
)


class _Ids(RandomIdGenerator):
    """Random ids, except for an execution's span: the ids it was given at accept."""

    def generate_span_id(self) -> int:
        fixed = _FIXED.get()
        return fixed[1] if fixed is not None else super().generate_span_id()

    def generate_trace_id(self) -> int:
        fixed = _FIXED.get()
        return fixed[0] if fixed is not None else super().generate_trace_id()


class _Trace:
    """An execution's trace as its record keeps it."""

    __slots__ = ("flags", "parent", "span_id", "trace_id")

    def __init__(self, trace_id: int, span_id: int, parent: int, flags: int) -> None:
        self.trace_id, self.span_id, self.parent, self.flags = trace_id, span_id, parent, flags

    def __str__(self) -> str:
        parent = f"{self.parent:016x}" if self.parent else "-"
        return f"{self.trace_id:032x} {self.span_id:016x} {parent} {self.flags:02x}"

    @classmethod
    def parse(cls, text: str) -> _Trace | None:
        try:
            trace_id, span_id, parent, flags = text.split()
            return cls(
                int(trace_id, 16),
                int(span_id, 16),
                0 if parent == "-" else int(parent, 16),
                int(flags, 16),
            )
        except ValueError:
            return None

    def span_context(self) -> SpanContext:
        return SpanContext(self.trace_id, self.span_id, False, TraceFlags(self.flags))


class _BlockSpan(BlockSpan):
    __slots__ = ("done", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.done = False

    def outcome(self, outcome: str, error_code: str | None = None) -> None:
        self.done = True
        self.span.set_attribute("flowcast.block.outcome", outcome)
        if error_code is not None:
            self.span.set_attribute("flowcast.block.error.code", error_code)
            self.span.set_status(Status(StatusCode.ERROR, error_code))


MS_NS = 1_000_000


def _ns(ts: str) -> int:
    """Ns since the epoch of a record's or an event's UTC timestamp (ms precision)."""
    moment = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


class Otel:
    """The tracer provider of this process and what Flowcast asks of it."""

    def __init__(self, exporter: SpanExporter, *, redis: bool = False) -> None:
        resource = Resource.create(
            {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "flowcast"}
        )
        self.provider = TracerProvider(resource=resource, id_generator=_Ids())
        self.processor: SpanProcessor = BatchSpanProcessor(exporter)
        self.provider.add_span_processor(self.processor)
        trace.set_tracer_provider(self.provider)
        self.tracer = self.provider.get_tracer("flowcast")
        # Outbound calls (``http`` and ``llm`` blocks) get a client span and carry
        # ``traceparent``; the served requests are the app's (app/tracing.py).
        HTTPXClientInstrumentor().instrument(tracer_provider=self.provider)
        if redis:
            # Every command a span, the background loops' too: asked for by name.
            from opentelemetry.instrumentation.redis import RedisInstrumentor

            RedisInstrumentor().instrument(tracer_provider=self.provider)

    @classmethod
    def from_env(cls, *, redis: bool = False) -> Otel:
        exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
        exporter: SpanExporter
        if exporter_name == "console":
            exporter = ConsoleSpanExporter()
        else:
            if exporter_name != "otlp":
                log.warning(
                    "unsupported OTEL_TRACES_EXPORTER; exporting over OTLP/HTTP",
                    extra={"exporter": exporter_name},
                )
            exporter = OTLPSpanExporter()
        log.info("traces on", extra={"exporter": exporter_name, "redis": redis})
        return cls(exporter, redis=redis)

    def new_trace(self) -> str:
        parent = trace.get_current_span().get_span_context()
        ids = self.provider.id_generator
        if parent.is_valid:
            span_id = ids.generate_span_id()
            return str(_Trace(parent.trace_id, span_id, parent.span_id, parent.trace_flags))
        trace_id = ids.generate_trace_id()
        sampled = self.provider.sampler.should_sample(None, trace_id, "flowcast.execution")
        kept = sampled.decision is Decision.RECORD_AND_SAMPLE
        flags = TraceFlags.SAMPLED if kept else TraceFlags.DEFAULT
        return str(_Trace(trace_id, ids.generate_span_id(), 0, flags))

    @contextlib.contextmanager
    def execution_context(self, text: str) -> Iterator[None]:
        kept = _Trace.parse(text)
        if kept is None:
            # Accepted while tracing was off (here or where it was accepted): it stays
            # untraced, its block attempts and outbound calls too (no stray roots).
            with suppress_instrumentation():
                yield
            return
        token = context.attach(trace.set_span_in_context(NonRecordingSpan(kept.span_context())))
        try:
            yield
        finally:
            context.detach(token)

    @contextlib.contextmanager
    def block_span(
        self, execution_id: str, block_id: str, block_type: str, attempt: int
    ) -> Iterator[BlockSpan]:
        if not is_instrumentation_enabled():
            yield _NO_SPAN  # an untraced execution's
            return
        attributes: dict[str, str | int] = {
            "flowcast.execution.id": execution_id,
            "flowcast.block.id": block_id,
            "flowcast.block.type": block_type,
            "flowcast.block.attempt": attempt,
        }
        with self.tracer.start_as_current_span(
            "flowcast.block",
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            told = _BlockSpan(span)
            try:
                yield told
            except BaseException as exc:
                if not told.done:
                    cancelled = isinstance(exc, asyncio.CancelledError | GeneratorExit)
                    told.outcome("cancelled" if cancelled else "error")
                raise

    def end_execution(
        self, identity: Mapping[str, str], execution_id: str, status: str, ts: str
    ) -> None:
        kept = _Trace.parse(identity.get(Field.TRACE.value, ""))
        created = identity.get(Field.CREATED_AT.value, "")
        if kept is None or not created:
            return  # accepted while tracing was off here or elsewhere: no span to end
        parent = context.Context()
        if kept.parent:
            remote = SpanContext(kept.trace_id, kept.parent, True, TraceFlags(kept.flags))
            parent = trace.set_span_in_context(NonRecordingSpan(remote), parent)
        attributes = {
            "flowcast.execution.id": execution_id,
            "flowcast.workflow.id": identity.get(Field.WORKFLOW_ID.value, ""),
            "flowcast.execution.status": status,
        }
        # A copy of this context: the fixed ids are this span's only.
        contextvars.copy_context().run(self._export, kept, parent, attributes, created, ts)

    def _export(
        self,
        kept: _Trace,
        parent: context.Context,
        attributes: dict[str, str],
        created: str,
        ts: str,
    ) -> None:
        _FIXED.set((kept.trace_id, kept.span_id))
        span = self.tracer.start_span(
            "flowcast.execution",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=_ns(created),
        )
        if attributes["flowcast.execution.status"] == "failed":
            span.set_status(Status(StatusCode.ERROR))
        # The end of the millisecond its terminal event was stamped in (timestamps have
        # ms precision): a block span that ended in that millisecond, before the event,
        # ends before its execution's span too (one ended 75 us after it in a CI run).
        span.end(end_time=max(_ns(ts), _ns(created)) + MS_NS - 1)
