"""Prometheus metrics for one Flowcast process (SPEC §10).

``Metrics`` owns its own registry, built when the app starts (never at import), and is
handed to the parts that count: the writer (events written, write failures, dropped
events), the compactor (bytes offloaded, offload failures), the stream readers (gaps
served, stream latency), the runner (executions by outcome, queue waits) and the
dispatcher (reclaims, stale deliveries). Gauges whose value lives elsewhere (pending
backlog, SSE clients, slots used) are read at scrape time through callbacks; the queue's
backlog lives in Redis and is read by ``refresh`` before each scrape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lib.errors import FlowcastError

if TYPE_CHECKING:
    from lib.execution.queue import Backlog

log = logging.getLogger(__name__)

# Stream latency buckets in seconds: fine below 10 ms, where the targets are.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Event loop lag buckets in seconds: fine around the 50 ms bound of SPEC §8.
LOOP_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
# Queue wait buckets in seconds, accepted -> started: from a start with a free slot
# (a few ms) to a backlog drained over minutes.
WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0, 300.0, 1800.0)


# How long a scrape waits for the queue's figures before it gives the last ones.
REFRESH_SECONDS = 0.5


class Metrics:
    """Every instrument of one process, on a registry of its own."""

    def __init__(self) -> None:
        """Each instrument on this registry. Longer than most: one flat declaration per
        instrument, each with its name and help text, read as a list."""
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.executions = Counter(
            "flowcast_executions_total",
            "Executions that reached a status in this process (started, paused, completed, …)",
            ["status"],
            registry=registry,
        )
        self.events_written = Counter(
            "flowcast_events_written_total", "Events stored in the replay buffer", registry=registry
        )
        self.bytes_written = Counter(
            "flowcast_event_bytes_written_total",
            "Envelope bytes stored in the replay buffer",
            registry=registry,
        )
        self.buffer_write_failures = Counter(
            "flowcast_buffer_write_failures_total",
            "Batch writes to the buffer that failed and will be retried",
            registry=registry,
        )
        self.events_dropped = Counter(
            "flowcast_events_dropped_total",
            "Events dropped from the pending backlog while the buffer was unreachable",
            registry=registry,
        )
        self.bytes_offloaded = Counter(
            "flowcast_bytes_offloaded_total",
            "Bytes of large values written to the value store",
            registry=registry,
        )
        self.offload_failures = Counter(
            "flowcast_offload_failures_total",
            "Large values the value store did not take after retries",
            registry=registry,
        )
        self.replay_gaps = Counter(
            "flowcast_replay_gaps_total",
            "replay:gap frames sent to clients",
            ["reason"],
            registry=registry,
        )
        self.loop_lag = Histogram(
            "flowcast_event_loop_lag_seconds",
            "How late the event loop woke a timer: what every request waited too",
            buckets=LOOP_BUCKETS,
            registry=registry,
        )
        self.loop_held = Histogram(
            "flowcast_event_loop_held_seconds",
            "The part of that lag the loop spent running code, not waiting for a CPU",
            buckets=LOOP_BUCKETS,
            registry=registry,
        )
        self.stream_latency = Histogram(
            "flowcast_stream_latency_seconds",
            "From an event's emit to its frame being handed to a live client's connection",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.pending = Gauge(
            "flowcast_pending_events", "Events emitted here and not yet stored", registry=registry
        )
        self.sse_clients = Gauge(
            "flowcast_sse_clients", "SSE clients connected to this process", registry=registry
        )
        self.bytes_retained = Gauge(
            "flowcast_bytes_retained",
            "Bytes the executions running here retain in their rings (as modelled)",
            registry=registry,
        )
        # The queue (SPEC §14): the signals an autoscaler needs.
        self.queue_depth = Gauge(
            "flowcast_queue_depth",
            "Executions by queue state: queued, in every tenant's line (the same figure"
            " on every process); running, in this process (sum over processes)",
            ["state"],
            registry=registry,
        )
        self.queue_oldest = Gauge(
            "flowcast_queue_oldest_seconds",
            "How long the oldest execution at the head of a tenant's line has waited"
            " (0: nothing waits)",
            registry=registry,
        )
        self.queue_wait = Histogram(
            "flowcast_queue_wait_seconds",
            "From an execution accepted to its start here (0 when a slot took it at once)",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.worker_slots = Gauge(
            "flowcast_worker_slots",
            "Executions this process may run at once (FLOWCAST_WORKER_SLOTS; 0: API only)",
            registry=registry,
        )
        self.worker_slots_used = Gauge(
            "flowcast_worker_slots_used",
            "Executions running in this process now (started, taken, resumed or taken over)",
            registry=registry,
        )
        self.queue_reclaims = Counter(
            "flowcast_queue_reclaims_total",
            "Executions taken by a worker that died before claiming them, queued again here",
            registry=registry,
        )
        self.stale_deliveries = Counter(
            "flowcast_queue_stale_deliveries_total",
            "Executions taken from the queue here and dropped: cancelled, claimed by"
            " another worker, or gone",
            registry=registry,
        )
        self.webhook_attempts = Counter(
            "flowcast_webhook_attempts_total",
            "Webhook delivery attempts made here, by outcome (ok: answered 2xx; error)",
            ["outcome"],
            registry=registry,
        )
        self.webhook_deliveries = Counter(
            "flowcast_webhook_deliveries_total",
            "Webhook deliveries settled here, by outcome (delivered; failed: 410 or retries spent)",
            ["outcome"],
            registry=registry,
        )
        self.webhook_oldest_pending = Gauge(
            "flowcast_webhook_oldest_pending_seconds",
            "Age of the oldest webhook delivery not yet delivered nor failed (0: none)",
            registry=registry,
        )
        self._backlog: Callable[[], Awaitable[Backlog]] | None = None
        self._oldest_webhook: Callable[[], Awaitable[int | None]] | None = None

    def watch(
        self,
        *,
        pending: Callable[[], float],
        sse_clients: Callable[[], float],
        bytes_retained: Callable[[], float],
    ) -> None:
        """Read these gauges from their owners at scrape time."""
        self.pending.set_function(pending)
        self.sse_clients.set_function(sse_clients)
        self.bytes_retained.set_function(bytes_retained)

    def watch_queue(
        self,
        *,
        backlog: Callable[[], Awaitable[Backlog]],
        slots: int,
        used: Callable[[], float],
    ) -> None:
        """Read the queue's backlog at scrape time (``refresh``), and this process's
        slots as they are."""
        self._backlog = backlog
        self.worker_slots.set(slots)
        self.worker_slots_used.set_function(used)
        self.queue_depth.labels("running").set_function(used)

    def watch_webhooks(self, oldest_pending_ms: Callable[[], Awaitable[int | None]]) -> None:
        """Read the oldest pending webhook delivery at scrape time (``refresh``)."""
        self._oldest_webhook = oldest_pending_ms

    async def refresh(self) -> None:
        """Read what lives in Redis before a scrape (a failed read keeps the last
        figures: a scrape never fails because the queue could not be read)."""
        if self._oldest_webhook is not None:
            try:
                async with asyncio.timeout(REFRESH_SECONDS):
                    oldest = await self._oldest_webhook()
                age = 0.0 if oldest is None else max(0.0, time.time() - oldest / 1000)
                self.webhook_oldest_pending.set(age)
            except (FlowcastError, TimeoutError) as exc:
                error = str(exc) or type(exc).__name__
                log.warning("could not read the webhooks for /metrics", extra={"error": error})
        if self._backlog is None:
            return
        try:
            # Bounded: a store that hangs (paused, stopped) must not hold the scrape,
            # which an operator needs most then.
            async with asyncio.timeout(REFRESH_SECONDS):
                backlog = await self._backlog()
        except (FlowcastError, TimeoutError) as exc:
            error = str(exc) or type(exc).__name__
            log.warning("could not read the queue for /metrics", extra={"error": error})
            return
        self.queue_depth.labels("queued").set(backlog.queued)
        waited = 0.0
        if backlog.oldest_ms is not None:
            waited = max(0.0, time.time() - backlog.oldest_ms / 1000)
        self.queue_oldest.set(waited)

    def render(self) -> bytes:
        """The text exposition format for ``/metrics``."""
        return generate_latest(self.registry)
