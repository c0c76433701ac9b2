"""Prometheus metrics for one Flowcast process (SPEC §10).

``Metrics`` owns its own registry, built when the app starts (never at import), and is
handed to the parts that count: the writer (events written, write failures, dropped
events), the compactor (bytes offloaded, offload failures), the stream readers (gaps
served, stream latency) and the runner (executions by outcome). Gauges whose value lives
elsewhere (pending backlog, SSE clients) are read at scrape time through callbacks.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Stream latency buckets in seconds: fine below 10 ms, where the targets are.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Event loop lag buckets in seconds: fine around the 50 ms bound of SPEC §8.
LOOP_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


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

    def render(self) -> bytes:
        """The text exposition format for ``/metrics``."""
        return generate_latest(self.registry)
