"""What the fault storm does, decided before anything runs: the workflows, the load
(``Shape``), one ``Plan`` per execution drawn from the seed, and the cycle of faults."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from stress.workflows import APPROVAL_SCHEMA, words

LEASE_SECONDS = 1.0
GRACE_SECONDS = 2.0
BUDGET_BYTES = 256 * 1024
MAX_PENDING_EVENTS = 300  # small, so an outage during a flood drops a range
ASK_TIMEOUT_SECONDS = 2
ODD_CURSOR = 1_000_000
BIG_INPUT_BYTES = 400 * 1024

# When a fault starts, as a fraction of one cycle; what it is; its length or pause (s).
# The data-losing restarts come early, so most executions end in a store that keeps them.
CYCLE: tuple[tuple[float, str, float], ...] = (
    (0.04, "pause-writes", 1.2),
    (0.10, "debug-sleep", 0.7),
    (0.17, "valkey-aof", 1.0),
    (0.25, "valkey-empty", 0.5),
    (0.33, "replica-kill", 0.5),
    (0.40, "pause-writes", 0.8),
    (0.47, "snapshot", 0.0),  # runs in flight between these two are rolled back
    (0.54, "valkey-snapshot", 0.5),
    (0.62, "debug-sleep", 1.6),  # longer than the lease
    (0.70, "replica-term", 0.0),
    (0.80, "pause-writes", 1.0),
    (0.88, "valkey-aof", 0.8),
)
VALKEY_FAULTS = {
    "pause-writes",
    "debug-sleep",
    "valkey-aof",
    "snapshot",
    "valkey-snapshot",
    "valkey-empty",
}
KINDS = {"talk": 30, "fan": 20, "ask": 25, "ask-timeout": 15, "flood": 5}
WORKFLOW_OF = {
    "talk": "fs-talk",
    "big": "fs-talk",
    "fan": "fs-fan",
    "ask": "fs-ask",
    "ask-timeout": "fs-ask-timeout",
    "flood": "fs-flood",
}
# What is done to a paused execution (the others: a cancel storm, or nothing), by weight.
ACTIONS = {
    "ask": {"resumes": 45, "resume-cancel": 25, "cancels": 15, "none": 15},
    "ask-timeout": {"resumes": 30, "late-resumes": 30, "resume-cancel": 10, "none": 30},
}


@dataclass(frozen=True)
class Shape:
    """How much load: executions started over ``window`` seconds, fault cycles in it."""

    executions: int
    window: float
    cycles: int
    seconds: float  # wall-clock budget of the load
    settle: float = 4.0 + LEASE_SECONDS + GRACE_SECONDS + 3.0  # natural end + lease + grace
    stream_end: float = LEASE_SECONDS + GRACE_SECONDS + 3.0  # a stream ends after its terminal

    @property
    def requests(self) -> int:
        return self.executions * 30 + 1000


SHORT = Shape(executions=120, window=30.0, cycles=1, seconds=75)
LONG = Shape(executions=600, window=150.0, cycles=4, seconds=300)


# -- the workflows ---------------------------------------------------------------------


def storm_workflows() -> list[dict[str, Any]]:
    """The five workflows, loaded from files so a wiped Valkey does not lose them."""
    talk = {
        "id": "fs-talk",
        "blocks": [
            {"id": "intro", "type": "transform", "config": {"value": {"n": "{{ input.n }}"}}},
            generate("talk", words(80, "t"), 20),
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.intro.output }}"}},
        ],
        "edges": [{"from": "intro", "to": "talk"}, {"from": "talk", "to": "done"}],
    }
    branches: list[dict[str, Any]] = [
        {"id": "d0", "type": "delay", "config": {"ms": 300}},
        generate("g1", words(12, "g1"), 20),
        {"id": "d2", "type": "delay", "config": {"ms": 900}},
        generate("g3", words(12, "g3"), 0),
        {"id": "d4", "type": "delay", "config": {"ms": 1500}},
        generate("g5", words(24, "g5"), 30),
    ]
    fan = {
        "id": "fs-fan",
        "blocks": [
            *branches,
            {"id": "sink", "type": "transform", "config": {"value": {"n": "{{ input.n }}"}}},
        ],
        "edges": [{"from": branch["id"], "to": "sink"} for branch in branches],
    }
    # About 370 KB of envelopes in 3 s: the ring must evict to stay within the budget, and
    # an outage meanwhile leaves more than MAX_PENDING_EVENTS waiting.
    flood_text = "{% for i in range(1100) %}f{{ i }}-{{ 'x' * 200 }} {% endfor %}"
    flood = {"id": "fs-flood", "blocks": [generate("flood", flood_text, 400)], "edges": []}
    asks = [ask_workflow("fs-ask", None), ask_workflow("fs-ask-timeout", ASK_TIMEOUT_SECONDS)]
    return [talk, fan, *asks, flood]


def generate(block_id: str, text: str, tokens_per_second: float) -> dict[str, Any]:
    config = {"text": text, "tokensPerSecond": tokens_per_second}
    return {"id": block_id, "type": "generate", "config": config}


def ask_workflow(workflow_id: str, timeout_seconds: int | None) -> dict[str, Any]:
    """lead (delay) → ask (approval) → talk (generate) → done (echoes the answer)."""
    ask: dict[str, Any] = {"prompt": "Go on with {{ input.n }}?", "schema": APPROVAL_SCHEMA}
    if timeout_seconds is not None:
        ask["timeoutSeconds"] = timeout_seconds
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "lead", "type": "delay", "config": {"ms": 50}},
            {"id": "ask", "type": "approval", "config": ask},
            generate("talk", words(16, "a"), 32),
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ],
        "edges": [
            {"from": "lead", "to": "ask"},
            {"from": "ask", "to": "talk"},
            {"from": "talk", "to": "done"},
        ],
    }


# -- the plan --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one execution of the storm does, drawn from the seed before anything runs."""

    number: int
    kind: str
    at: float  # seconds after the load starts
    via: int  # the replica slot it is started on
    streaming: bool  # started by a streaming execute, whose reader is the owner's
    readers: tuple[tuple[str, int], ...]  # (role, replica slot): from0, dropper, odd
    action: str  # none, resumes, late-resumes, resume-cancel, cancels, cancel-storm
    delay: float  # before the action: after the pause was seen, or after the start
    resumes: int
    cancels: int
    seed: int


def make_plans(shape: Shape, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=shape.executions)
    for number in (7, shape.executions // 2):
        kinds[number] = "big"
    plans = []
    for number, kind in enumerate(kinds):
        at = shape.window * 0.92 * (number + rng.random()) / shape.executions
        via = rng.randrange(2)
        streaming = kind != "big" and rng.random() < 0.2
        readers: list[tuple[str, int]] = []
        if not streaming or rng.random() < 0.5:
            readers.append(("from0", rng.randrange(2)))
        if rng.random() < 0.4:
            readers.append(("dropper", rng.randrange(2)))
        if rng.random() < 0.12:
            readers.append(("odd", rng.randrange(2)))
        actions = ACTIONS.get(kind, {"cancel-storm": 25, "none": 75})
        action = rng.choices(list(actions), weights=list(actions.values()))[0]
        resumes, cancels = {
            "resumes": (rng.randint(2, 4), 0),
            "late-resumes": (2, 0),
            "resume-cancel": (rng.randint(1, 2), rng.randint(1, 2)),
            "cancels": (0, rng.randint(2, 3)),
            "cancel-storm": (1, rng.randint(1, 3)),
        }.get(action, (0, 0))
        if action == "late-resumes":  # right at the approval deadline
            delay = ASK_TIMEOUT_SECONDS - 0.1 + rng.uniform(-0.2, 0.2)
        elif action == "cancel-storm":
            delay = rng.uniform(0.05, 1.5)
        else:
            delay = rng.uniform(0.0, 1.2)
        plans.append(
            Plan(number, kind, at, via, streaming, tuple(readers), action, delay, resumes,
                 cancels, rng.randrange(2**32))
        )  # fmt: skip
    return plans
