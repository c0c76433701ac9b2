"""What the queue storm (``stress/queue_storm.py``) runs and records: its settings,
its two shapes, its workflows, and the records of each execution and each worker lost,
which its verdict (``stress/queue_checks.py``) reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stress.harness import View
from stress.recovery_storm import edges, generate
from stress.workflows import words
from tests.support.servers import FlowcastWorker

WORKERS = 3
SLOTS = 6  # each worker's
LEASE_SECONDS = 1.0
GRACE_SECONDS = 1.0
SPREAD = 12  # the heavy tenant's workflows


@dataclass(frozen=True)
class Shape:
    """How much load, and how many kill cycles."""

    window: float  # seconds of load; phase A is its first half
    flood: int  # the heavy tenant's burst at the start
    heavy_level: int  # then its line is kept at this many queued
    light_interval: float  # phase A: one light start every this (jittered)
    light_level: int  # phase B: the light tenant's line kept at this many queued
    kills: int  # kill cycles: a SIGKILL, or one in every term_every a SIGTERM
    term_every: int
    seconds: float  # the budget of the load

    def cycle_times(self) -> list[float]:
        """When each cycle begins, seconds into the load: spread over the window,
        leaving its first and last tenth alone."""
        span = 0.8 * self.window
        return [0.1 * self.window + span * (n + 0.5) / self.kills for n in range(self.kills)]


SHORT = Shape(
    window=12, flood=60, heavy_level=48, light_interval=0.25, light_level=16,
    kills=3, term_every=3, seconds=60,
)  # fmt: skip
LONG = Shape(
    window=360, flood=300, heavy_level=60, light_interval=0.25, light_level=16,
    kills=120, term_every=6, seconds=720,
)  # fmt: skip


def queue_workflows(tag: str, count: int) -> list[dict[str, Any]]:
    """``count`` short workflows: intro (transform), then a delay or a streaming
    generate, then a transform that echoes the intro's output."""
    made = []
    for index in range(count):
        intro = {"id": "intro", "type": "transform", "config": {"value": {"n": "{{ input.n }}"}}}
        if index % 2 == 0:
            middle = {"id": "mid", "type": "delay", "config": {"ms": 500 + 40 * (index % 5)}}
        else:
            middle = generate("mid", words(10, f"{tag}{index}"), 20)
        done = {"id": "done", "type": "transform", "config": {"value": "{{ blocks.intro.output }}"}}
        made.append(
            {
                "id": f"qs-{tag}-{index:02d}",
                "blocks": [intro, middle, done],
                "edges": edges(["intro", "mid", "done"]),
            }
        )
    return made


@dataclass
class Execution:
    """One accepted execution and its client."""

    tenant: str  # heavy or light
    phase: str  # A or B (by when it was posted)
    workflow: dict[str, Any]
    number: int
    execution_id: str = ""
    posted_wall: float = 0.0
    view: View | None = None
    log: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Loss:
    """One worker lost: SIGKILLed or SIGTERMed, with what it ran then."""

    kind: str  # kill, term
    slot: int
    node: str
    used: float  # its slots in use by its /metrics just before
    at: float  # seconds into the load
    signalled_wall: float = 0.0
    exited_wall: float = 0.0
    owned: list[str] = field(default_factory=list)
    restart_after: float = 0.0


@dataclass
class WorkerSlot:
    index: int
    server: FlowcastWorker
    node: str = ""
    state: str = "up"  # up, down
