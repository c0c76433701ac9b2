"""The fault storm: SPEC §3, §4, §5 and §7 under faults, on real processes.

Two Flowcast replicas (lease 1 s, byte budget 256 KiB, shutdown grace 2 s) on one
Valkey with AOF run a seeded mix of executions: streaming ``generate`` blocks, ``delay``
blocks, parallel branches, ``approval`` pauses (some with ``timeoutSeconds``), a few
floods past the byte budget and a few with an input larger than the budget. SSE clients
follow them from both replicas: readers from the start (or the streaming execute
itself), readers that drop and reconnect with ``Last-Event-ID`` to either replica, and
readers whose cursor is far above the end. Resumes and cancels are fired at the same
instant at the same execution through both replicas, with duplicates. Meanwhile a
chaos task works through ``CYCLE``: writes paused, Valkey asleep, Valkey killed and
started again from its AOF, from an older snapshot and empty, one replica SIGKILLed and
one SIGTERMed, each replaced by a fresh process on a new port.

When the load is over the storm waits for every execution to end and every stream to
close, collects what the store holds, and ``stress/fault_checks.py`` judges it all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from stress.harness import Budget, BudgetExceeded, Report, bounded, clock
from stress.workflows import APPROVAL_SCHEMA, words
from tests.support import faults
from tests.support.faults import FaultyValkey
from tests.support.logcheck import TERMINAL
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame, events

LEASE_SECONDS = 1.0
GRACE_SECONDS = 2.0
BUDGET_BYTES = 256 * 1024
MAX_PENDING_EVENTS = 300  # small, so an outage during a flood drops a range
ASK_TIMEOUT_SECONDS = 2
ODD_CURSOR = 1_000_000
COLLECT_SECONDS = 60
BIG_INPUT_BYTES = 400 * 1024
SSE = {"Accept": "text/event-stream"}
PREFIX = "fc"

log = logging.getLogger(__name__)

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


# -- what happened ---------------------------------------------------------------------


@dataclass
class Fault:
    """One injected fault and when it was in effect (monotonic and wall clock)."""

    kind: str
    began: float
    began_wall: float
    ended: float = 0.0
    ended_wall: float = 0.0
    lost_since_wall: float | None = None  # a data-losing restart: writes after this are gone
    detail: str = ""


@dataclass
class Answer:
    """One resume or cancel request of a group fired at the same instant."""

    kind: str
    group: str
    input: Any
    sent: float
    status: int | None = None  # None: no answer (transport error, no replica up)
    body: str = ""
    answered_wall: float = 0.0
    answered: float = 0.0
    paused_before: bool = False  # the snapshot said paused right before the group fired


@dataclass
class Reader:
    """One SSE client: everything it received over all its connections."""

    role: str  # owner (the streaming execute), from0, dropper, odd
    slot: int
    rng: random.Random
    start: int = 0
    bites: int = 0  # connections left that read only a few events before dropping
    frames: list[Frame] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # wall clock of each frame
    late_frames: list[Frame] = field(default_factory=list)  # after the terminal event
    connections: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: int = 0
    broken_frames: int = 0
    kept_open: bool = False  # the server did not close the stream after the terminal
    ended: str = ""  # terminal, 204, 404, or why it stopped
    ended_wall: float = 0.0

    @property
    def cursor(self) -> int:
        for frame in reversed(self.frames):
            if frame.id is not None:
                return int(frame.id)
        return self.start

    @property
    def label(self) -> str:
        return (
            f"{self.role} reader (cursor {self.start}, first on replica {self.slot}, "
            f"{self.connections} connections)"
        )

    def end(self, how: str) -> None:
        if not self.ended:
            self.ended, self.ended_wall = how, time.time()


@dataclass
class Run:
    """One planned execution and everything about it."""

    plan: Plan
    execution_id: str = ""
    sent_wall: float = 0.0
    accepted_wall: float = 0.0
    readers: list[Reader] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    # Filled after the load.
    status: str | None = None  # the final snapshot status; None: 404
    terminal_wall: float | None = None
    log: list[dict[str, Any]] | None = None
    dropped: list[tuple[int, int]] = field(default_factory=list)
    # The stored log of a finished execution as read right before a restart lost it.
    log_before_loss: list[dict[str, Any]] | None = None
    dropped_before_loss: list[tuple[int, int]] = field(default_factory=list)

    @property
    def workflow_id(self) -> str:
        return WORKFLOW_OF[self.plan.kind]

    def input(self) -> dict[str, Any]:
        if self.plan.kind == "big":
            return {"n": self.plan.number, "blob": "b" * BIG_INPUT_BYTES}
        return {"n": self.plan.number}

    def accept(self, execution_id: str, sent_wall: float) -> None:
        self.execution_id, self.sent_wall, self.accepted_wall = execution_id, sent_wall, time.time()
        self.started.set()

    def saw(self, frame: Frame) -> None:
        if frame.event == "execution:paused":
            self.paused.set()


@dataclass
class ServerError:
    wall: float
    status: int
    method: str
    path: str
    port: int
    body: str


# -- the replicas ----------------------------------------------------------------------


@dataclass
class Slot:
    index: int
    server: FlowcastServer
    client: httpx.AsyncClient
    state: str = "up"  # up, draining, down


class Replicas:
    """Two Flowcast processes in slots; a killed or stopped one is replaced in its slot
    by a fresh process on a new port. Every request through their clients is counted."""

    def __init__(self, root: Path, env: dict[str, str], report: Report) -> None:
        self._root = root
        self._env = env
        self._report = report
        self.slots: list[Slot] = []
        self.servers: list[FlowcastServer] = []  # every process ever started
        self.clients: list[httpx.AsyncClient] = []
        self.errors: list[ServerError] = []
        self.draining_ports: set[int] = set()

    async def start(self, count: int = 2) -> None:
        servers = [
            FlowcastServer(data_dir=self._root / f"replica-{index}", env=self._env)
            for index in range(count)
        ]
        self.servers += servers
        await asyncio.gather(*(server.start() for server in servers))
        self.slots = [Slot(n, server, self._client(server)) for n, server in enumerate(servers)]

    def _client(self, server: FlowcastServer) -> httpx.AsyncClient:
        report = self._report

        async def count(request: httpx.Request) -> None:
            report.requests += 1
            if report.requests > report.budget.requests and not report.checking:
                raise BudgetExceeded(f"{report.name}: more than {report.budget.requests} requests")

        async def judge(response: httpx.Response) -> None:
            report.statuses[response.status_code] += 1
            if response.status_code >= 500:
                await response.aread()
                request = response.request
                self.errors.append(
                    ServerError(time.time(), response.status_code, request.method,
                                request.url.path, request.url.port or 0, response.text[:200])
                )  # fmt: skip

        client = httpx.AsyncClient(
            base_url=server.url,
            timeout=httpx.Timeout(30, read=15),
            limits=httpx.Limits(max_connections=600, max_keepalive_connections=100),
            event_hooks={"request": [count], "response": [judge]},
        )
        self.clients.append(client)
        return client

    def pick(self, rng: random.Random, prefer: int | None = None) -> Slot | None:
        """The preferred slot if it is up, else a random slot that is up (None: none)."""
        if prefer is not None and self.slots[prefer].state == "up":
            return self.slots[prefer]
        up = [slot for slot in self.slots if slot.state == "up"]
        return rng.choice(up) if up else None

    async def all_up(self) -> None:
        while any(slot.state != "up" for slot in self.slots):
            await asyncio.sleep(0.05)

    async def kill(self, index: int, pause: float) -> None:
        slot = self.slots[index]
        slot.state = "down"
        await faults.kill_replica(slot.server)
        await asyncio.sleep(pause)
        await self._replace(slot)

    async def terminate(self, index: int) -> None:
        slot = self.slots[index]
        slot.state = "draining"
        self.draining_ports.add(slot.server.port)
        await faults.terminate_replica(slot.server, timeout=GRACE_SECONDS + 15)
        slot.state = "down"
        await self._replace(slot)

    async def _replace(self, slot: Slot) -> None:
        server = await faults.fresh_replica(slot.server)
        self.servers.append(server)
        slot.server, slot.client, slot.state = server, self._client(server), "up"

    async def close(self) -> None:
        await asyncio.gather(*(slot.server.stop() for slot in self.slots), return_exceptions=True)
        await asyncio.gather(*(client.aclose() for client in self.clients))


# -- the storm -------------------------------------------------------------------------


class Storm:
    """Runs the load and the chaos, then waits for the ends and collects the store."""

    def __init__(self, root: Path, shape: Shape, seed: int, report: Report) -> None:
        self.root = root
        self.shape = shape
        self.report = report
        self.rng = random.Random(seed)
        self.runs = [Run(plan) for plan in make_plans(shape, seed)]
        self.valkey = FaultyValkey(data_dir=root / "valkey")
        self.replicas: Replicas | None = None
        self.faults: list[Fault] = []
        self.peaks: dict[str, tuple[int, dict[str, int]]] = {}  # eid: (bytes, by key)
        self.start_problems: list[str] = []
        self.began = 0.0
        self.load_ended_wall = 0.0
        self._background: set[asyncio.Task[None]] = set()
        self._reader_tasks: list[asyncio.Task[None]] = []

    @property
    def accepted(self) -> list[Run]:
        return [run for run in self.runs if run.execution_id]

    @property
    def live(self) -> Replicas:
        assert self.replicas is not None
        return self.replicas

    def env(self) -> dict[str, str]:
        workflows = self.root / "workflows"
        workflows.mkdir(parents=True, exist_ok=True)
        for workflow in storm_workflows():
            (workflows / f"{workflow['id']}.json").write_text(json.dumps(workflow))
        return {
            "FLOWCAST_REDIS_URL": self.valkey.url,
            "FLOWCAST_WORKFLOWS_DIR": str(workflows),
            "FLOWCAST_LEASE_SECONDS": str(LEASE_SECONDS),
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": str(GRACE_SECONDS),
            "FLOWCAST_EVENT_BUDGET_BYTES": str(BUDGET_BYTES),
            "FLOWCAST_MAX_PENDING_EVENTS": str(MAX_PENDING_EVENTS),
            "FLOWCAST_SSE_PING_SECONDS": "1",
            "FLOWCAST_SECRET_KEY": "fault-storm-shared-secret",
            "FLOWCAST_LOG_LEVEL": "warning",
        }

    async def run(self) -> None:
        """Everything: processes up, load and chaos, the ends awaited, the store read."""
        await self.valkey.start()
        self.replicas = Replicas(self.root, self.env(), self.report)
        try:
            await self.live.start()
            log.info("replicas up: %s", [slot.server.port for slot in self.live.slots])
            async with asyncio.TaskGroup() as streams:
                sampler = asyncio.create_task(self._sample_forever())
                try:
                    await bounded(self.report, self._load(streams))
                    self.load_ended_wall = time.time()
                    log.info("load over in %.1f s; settling", self.report.seconds)
                    await self._settle()
                    log.info("settled; waiting for the streams")
                    await self._wait_streams()
                finally:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
            log.info("collecting the stored logs")
            async with asyncio.timeout(COLLECT_SECONDS):
                await self._collect()
            self.dump(self.root / "fault-storm.json")
            log.info("collected")
        finally:
            await self.live.close()
            await self.valkey.stop()

    # -- the load --------------------------------------------------------------------

    async def _load(self, streams: asyncio.TaskGroup) -> None:
        self.began = clock()
        async with asyncio.TaskGroup() as load:
            load.create_task(self._chaos())
            for run in self.runs:
                load.create_task(self._drive(run, streams))
        await self._sweep()

    async def _drive(self, run: Run, streams: asyncio.TaskGroup) -> None:
        plan = run.plan
        await asyncio.sleep(max(0.0, self.began + plan.at - clock()))
        rng = random.Random(plan.seed)
        if plan.streaming:
            owner = Reader("owner", plan.via, random.Random(rng.random()))
            run.readers.append(owner)
            request = ("POST", f"/api/workflows/{run.workflow_id}/execute", {"input": run.input()})
            self._reader_tasks.append(streams.create_task(self._follow(owner, run, request)))
            await run.started.wait()
        else:
            await self._start(run, rng)
        if not run.execution_id:
            return
        for role, slot in plan.readers:
            reader = Reader(role, slot, random.Random(rng.random()))
            reader.start = ODD_CURSOR if role == "odd" else 0
            reader.bites = rng.randint(2, 6) if role == "dropper" else 0
            run.readers.append(reader)
            self._reader_tasks.append(streams.create_task(self._follow(reader, run, None)))
        await self._act(run, rng)

    async def _start(self, run: Run, rng: random.Random) -> None:
        """POST execute (202), again while the answer is a 503 or nothing, for 15 s."""
        deadline = clock() + 15
        while clock() < deadline:
            slot = self.live.pick(rng, prefer=run.plan.via)
            if slot is None:
                await asyncio.sleep(0.1)
                continue
            sent = time.time()
            try:
                response = await slot.client.post(
                    f"/api/workflows/{run.workflow_id}/execute", json={"input": run.input()}
                )
            except httpx.TransportError:
                await asyncio.sleep(0.2)
                continue
            if response.status_code == 202:
                run.accept(response.json()["executionId"], sent)
                return
            if response.status_code != 503:
                problem = f"{response.status_code}: {response.text[:200]}"
                self.start_problems.append(f"execute {run.workflow_id} answered {problem}")
                return
            await asyncio.sleep(0.2)
        run.started.set()

    async def _follow(self, reader: Reader, run: Run, request: tuple[str, str, Any] | None) -> None:
        """Read to the end (terminal, 204 or 404), reconnecting to any replica that is up."""
        try:
            await self._read_to_the_end(reader, run, request)
        except BudgetExceeded as exc:
            self.report.find(str(exc))
            reader.end("request budget")
            run.started.set()

    async def _read_to_the_end(
        self, reader: Reader, run: Run, request: tuple[str, str, Any] | None
    ) -> None:
        deadline = clock() + 15  # for the streaming execute to be answered at all
        while not reader.ended:
            starting = request is not None and not run.execution_id
            if starting and clock() > deadline:
                reader.end("never started")
                run.started.set()
                return
            prefer = reader.slot if reader.connections == 0 or starting else None
            slot = self.live.pick(reader.rng, prefer=prefer)
            if slot is None:
                await asyncio.sleep(0.1)
                continue
            limit = None
            if reader.bites > 0:
                reader.bites -= 1
                limit = reader.rng.randint(3, 40)
            again = await self._connect(reader, run, slot, request if starting else None, limit)
            if again:
                await asyncio.sleep(0.2 + 0.2 * reader.rng.random())  # EventSource's retry
            elif limit is not None:
                await asyncio.sleep(0.3 * reader.rng.random())

    async def _connect(
        self,
        reader: Reader,
        run: Run,
        slot: Slot,
        request: tuple[str, str, Any] | None,
        limit: int | None,
    ) -> bool:
        """One connection; True when the reader should reconnect."""
        if reader.frames and reader.frames[-1].id is None:
            reader.frames.pop()  # cut right after a gap frame: the same cursor gets it again
            reader.stamps.pop()
        if request is None:
            method, url, body = "GET", f"/api/executions/{run.execution_id}/stream", None
            headers = {**SSE, "Last-Event-ID": str(reader.cursor)}
        else:
            (method, url, body), headers = request, dict(SSE)
        reader.connections += 1
        self.report.connections += 1
        sent = time.time()
        try:
            async with slot.client.stream(method, url, headers=headers, json=body) as response:
                status = response.status_code
                reader.statuses[status] += 1
                if request is not None:
                    if status != 200:
                        await response.aread()
                        return True
                    run.accept(response.headers["x-execution-id"], sent)
                if status in (204, 404):
                    reader.end(str(status))
                    return False
                if status != 200:
                    await response.aread()
                    if status >= 500:
                        return True
                    reader.end(f"answered {status}: {response.text[:120]}")
                    return False
                return await self._read(reader, run, response, limit)
        except httpx.TransportError:
            reader.transport_errors += 1
            return True
        except AssertionError:  # the stream ended inside a frame (a process was killed)
            reader.broken_frames += 1
            return True

    async def _read(
        self, reader: Reader, run: Run, response: httpx.Response, limit: int | None
    ) -> bool:
        taken = 0
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as timer:
                async for frame in events(response):
                    if reader.ended:
                        reader.late_frames.append(frame)
                        continue
                    reader.frames.append(frame)
                    reader.stamps.append(time.time())
                    self.report.frames += 1
                    if frame.id is None:
                        continue
                    taken += 1
                    run.saw(frame)
                    if frame.event in TERMINAL:
                        reader.end("terminal")  # read on: the server must close right after
                        timer.reschedule(loop.time() + 3)
                    elif limit is not None and taken >= limit:
                        return False
        except TimeoutError:
            reader.kept_open = True
        return not reader.ended

    # -- resumes and cancels ---------------------------------------------------------

    async def _act(self, run: Run, rng: random.Random) -> None:
        plan = run.plan
        if plan.action == "none":
            return
        if plan.action == "cancel-storm":
            await asyncio.sleep(plan.delay)
            await self.fire(run, rng, "storm", resumes=plan.resumes, cancels=plan.cancels)
            return
        try:
            async with asyncio.timeout(15):
                await run.paused.wait()
        except TimeoutError:
            return  # no reader saw the pause (its execution may be gone): nothing to answer
        await asyncio.sleep(plan.delay)
        paused = await self.status(run, rng) == "paused"
        await self.fire(
            run, rng, "answer", resumes=plan.resumes, cancels=plan.cancels, paused=paused
        )

    async def fire(
        self,
        run: Run,
        rng: random.Random,
        group: str,
        *,
        resumes: int,
        cancels: int,
        paused: bool = False,
    ) -> None:
        """Send ``resumes`` resumes (each with its own input) and ``cancels`` cancels at the
        same instant, alternately through the two replicas."""
        requests: list[tuple[str, Any]] = []
        for attempt in range(resumes):
            note = f"{run.plan.number}-{group}-r{attempt}"
            body: dict[str, Any] = {"input": {"approved": rng.random() < 0.8, "note": note}}
            if attempt % 2:
                body["blockId"] = "ask"
            requests.append(("resume", body))
        requests += [("cancel", None)] * cancels
        rng.shuffle(requests)
        first = rng.randrange(2)
        await asyncio.gather(
            *(
                self._post(run, kind, body, (first + index) % 2, group, paused, rng)
                for index, (kind, body) in enumerate(requests)
            )
        )

    async def _post(
        self,
        run: Run,
        kind: str,
        body: Any,
        slot_index: int,
        group: str,
        paused: bool,
        rng: random.Random,
    ) -> None:
        answer = Answer(kind, group, (body or {}).get("input"), clock(), paused_before=paused)
        run.answers.append(answer)
        slot = self.live.pick(rng, prefer=slot_index)
        if slot is not None:
            url = f"/api/executions/{run.execution_id}/{kind}"
            try:
                response = await slot.client.post(url, json=body)
                answer.status, answer.body = response.status_code, response.text[:200]
            except httpx.TransportError as exc:
                answer.body = f"{type(exc).__name__}: {exc}"
        answer.answered, answer.answered_wall = clock(), time.time()

    async def status(self, run: Run, rng: random.Random, tries: int = 20) -> str | None:
        """The snapshot's status ("gone" for a 404), retrying 503s and dead replicas."""
        for _ in range(tries):
            slot = self.live.pick(rng)
            if slot is not None:
                try:
                    response = await slot.client.get(f"/api/executions/{run.execution_id}")
                    if response.status_code == 200:
                        status: str = response.json()["status"]
                        return status
                    if response.status_code == 404:
                        return "gone"
                except httpx.TransportError:
                    pass
            await asyncio.sleep(0.2)
        return None

    async def _sweep(self) -> None:
        """Cancel every pause without a deadline that nobody answered, so every execution
        can end (a pause with ``timeoutSeconds`` must end by itself)."""
        await self.live.all_up()

        async def one(run: Run) -> None:
            rng = random.Random(run.plan.seed + 1)
            if await self.status(run, rng) == "paused":
                await self.fire(run, rng, "sweep", resumes=0, cancels=1)

        await asyncio.gather(*(one(run) for run in self.accepted if run.plan.kind == "ask"))

    # -- the chaos -------------------------------------------------------------------

    async def _chaos(self) -> None:
        span = self.shape.window / self.shape.cycles
        timeline = [
            (cycle * span + fraction * span, kind, argument)
            for cycle in range(self.shape.cycles)
            for fraction, kind, argument in CYCLE
        ]
        snapshot: tuple[Path, float] | None = None
        for at, kind, argument in timeline:
            await asyncio.sleep(max(0.0, self.began + at - clock()))
            fault = Fault(kind, clock(), time.time())
            self.faults.append(fault)
            log.info("fault %s (%s) at %.1f s", kind, argument, clock() - self.began)
            if kind == "pause-writes":
                await faults.pause_writes(self.valkey, int(argument * 1000))
                await asyncio.sleep(argument)
            elif kind == "debug-sleep":
                await faults.debug_sleep(self.valkey, argument)
            elif kind == "valkey-aof":
                await faults.crash_and_restart(self.valkey, down_seconds=argument)
            elif kind == "snapshot":
                path = self.root / "snapshots" / f"{len(self.faults)}.rdb"
                snapshot = (await faults.take_snapshot(self.valkey, path), time.time())
            elif kind == "valkey-snapshot":
                assert snapshot is not None, "CYCLE takes a snapshot before restoring one"
                await self._keep_finished_logs()
                fault.began, fault.began_wall, fault.lost_since_wall = (
                    clock(),
                    time.time(),
                    snapshot[1],
                )
                await faults.crash_and_restore(self.valkey, snapshot[0], down_seconds=argument)
            elif kind == "valkey-empty":
                await self._keep_finished_logs()
                fault.began, fault.began_wall, fault.lost_since_wall = clock(), time.time(), 0.0
                await faults.crash_and_wipe(self.valkey, down_seconds=argument)
            else:
                await self.live.all_up()  # never both replicas down at once
                index = self.rng.randrange(2)
                fault.detail = f"replica {index}, port {self.live.slots[index].server.port}"
                work = (
                    self.live.kill(index, argument)
                    if kind == "replica-kill"
                    else self.live.terminate(index)
                )
                self._replica_fault(fault, work)
                continue
            fault.ended, fault.ended_wall = clock(), time.time()
        await asyncio.gather(*self._background)

    def _replica_fault(self, fault: Fault, work: Any) -> None:
        # A replica fault runs beside the next ones: a drain takes the grace period.
        async def run() -> None:
            try:
                await work
            except Exception as exc:  # recorded, so the storm goes on with one replica
                self.report.find(f"fault {fault.kind} ({fault.detail}) failed: {exc!r}")
            fault.ended, fault.ended_wall = clock(), time.time()

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the ends --------------------------------------------------------------------

    async def _settle(self) -> None:
        """Poll every snapshot until it is terminal or gone, for ``shape.settle`` seconds."""
        rng = random.Random(0)
        waiting = list(self.accepted)
        deadline = clock() + self.shape.settle
        while waiting and clock() < deadline:
            statuses = await asyncio.gather(*(self.status(run, rng, tries=1) for run in waiting))
            for run, status in zip(waiting, statuses, strict=True):
                run.status = status
                if status in ("completed", "failed", "cancelled", "gone"):
                    run.terminal_wall = time.time()
            waiting = [run for run in waiting if run.terminal_wall is None]
            await asyncio.sleep(0.25)

    async def _wait_streams(self) -> None:
        """Give every open stream ``shape.stream_end`` seconds to end, then cut them."""
        pending = [task for task in self._reader_tasks if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.shape.stream_end)
        for task in pending:
            task.cancel()

    async def _keep_finished_logs(self) -> None:
        """Read the stored log of every execution a client saw end, before it is lost."""
        redis = Redis.from_url(self.valkey.url, socket_timeout=5)
        rng = random.Random(2)

        async def keep(run: Run) -> None:
            log = await self._stored_log(run, rng)
            if log and log[-1]["type"] in TERMINAL:
                run.log_before_loss, run.dropped_before_loss = log, await self._dropped(redis, run)

        finished = [
            run
            for run in self.accepted
            if run.log_before_loss is None and any(r.ended == "terminal" for r in run.readers)
        ]
        try:
            async with asyncio.timeout(10):
                await asyncio.gather(*(keep(run) for run in finished))
        except (TimeoutError, RedisError, httpx.HTTPError) as exc:
            self.report.find(f"could not read the finished logs before a restart: {exc!r}")
        finally:
            await redis.aclose()

    async def _dropped(self, redis: Redis, run: Run) -> list[tuple[int, int]]:
        """The execution's dropped ranges, as the store records them (inclusive)."""
        ranges = await redis.zrange(f"{PREFIX}:{{{run.execution_id}}}:dropped", 0, -1)
        bounds = (member.decode().partition("-") for member in ranges)
        return [(int(low), int(high)) for low, _, high in bounds]

    async def _collect(self) -> None:
        """The stored log, dropped ranges and final status of every execution."""
        redis = Redis.from_url(self.valkey.url, socket_timeout=10)
        try:
            await self._sample(redis)
            rng = random.Random(1)
            for run in self.accepted:
                run.status = await self.status(run, rng)
                run.log = await self._stored_log(run, rng)
                run.dropped = await self._dropped(redis, run)
                self.report.stored_events += len(run.log or [])
        finally:
            await redis.aclose()

    async def _stored_log(self, run: Run, rng: random.Random) -> list[dict[str, Any]] | None:
        found: list[dict[str, Any]] = []
        after = 0
        while True:
            slot = self.live.pick(rng)
            assert slot is not None, "both replicas are down after the storm"
            response = await slot.client.get(
                f"/api/executions/{run.execution_id}/events", params={"after": after, "limit": 1000}
            )
            if response.status_code == 404:
                return None
            if response.status_code in (500, 502, 503):
                await asyncio.sleep(0.2)  # the deadline of _collect bounds the retries
                continue
            response.raise_for_status()
            page = response.json()
            found += page["events"]
            if not page["events"]:
                return found
            after = page["nextAfter"]

    def dump(self, path: Path) -> None:
        """What happened, as JSON, to look into a finding: the faults, and for every
        execution its plan, end, stored event types, readers and answers."""

        def reader(item: Reader) -> dict[str, Any]:
            events = [f"{frame.id or '-'} {frame.event}" for frame in item.frames]
            return {
                "role": item.role, "slot": item.slot, "start": item.start,
                "ended": item.ended, "endedWall": item.ended_wall,
                "connections": item.connections, "statuses": dict(item.statuses),
                "transportErrors": item.transport_errors, "cursor": item.cursor,
                "events": events if len(events) <= 40 else [*events[:20], "…", *events[-20:]],
            }  # fmt: skip

        def run(item: Run) -> dict[str, Any]:
            types = [f"{e['id']} {e['type']}" for e in item.log or []]
            return {
                "executionId": item.execution_id, "plan": vars(item.plan),
                "sentWall": item.sent_wall, "acceptedWall": item.accepted_wall,
                "status": item.status, "terminalWall": item.terminal_wall,
                "stored": types if len(types) <= 40 else [*types[:20], "…", *types[-20:]],
                "end": (item.log or [{}])[-1].get("data"),
                "storedBeforeLoss": len(item.log_before_loss or []), "dropped": item.dropped,
                "readers": [reader(one) for one in item.readers],
                "answers": [vars(answer) for answer in item.answers],
                "peakBytes": self.peaks.get(item.execution_id, (0, {})),
            }  # fmt: skip

        faults_seen = [vars(fault) for fault in self.faults]
        errors = [vars(error) for error in self.live.errors]
        body = {"faults": faults_seen, "errors": errors, "runs": [run(item) for item in self.runs]}
        path.write_text(json.dumps(body, indent=1, default=str))

    # -- the Redis footprint ---------------------------------------------------------

    async def _sample_forever(self) -> None:
        redis = Redis.from_url(self.valkey.url, socket_timeout=5)
        try:
            while True:
                try:
                    await self._sample(redis)
                except (RedisError, OSError):
                    pass  # Valkey is down or asleep: the next sample
                await asyncio.sleep(1)
        finally:
            await redis.aclose()

    async def _sample(self, redis: Redis) -> None:
        """MEMORY USAGE of every key of every execution (hash tag ``{<eid>}``), summed."""
        keys = [key async for key in redis.scan_iter(match=f"{PREFIX}:{{*}}:*", count=1000)]
        async with redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.memory_usage(key, samples=0)
            sizes = await pipe.execute()
        totals: dict[str, dict[str, int]] = {}
        for key, size in zip(keys, sizes, strict=True):
            tag, _, suffix = key.decode().partition("{")[2].partition("}")
            totals.setdefault(tag, {})[suffix.lstrip(":")] = int(size or 0)
        for execution_id, parts in totals.items():
            total = sum(parts.values())
            if total > self.peaks.get(execution_id, (0, {}))[0]:
                self.peaks[execution_id] = (total, parts)


async def fault_storm(root: Path, *, long: bool = False, seed: int = 20261129) -> Report:
    """Executions under faults on two replicas and one Valkey; see the module docstring."""
    from stress.fault_checks import judge

    shape = LONG if long else SHORT
    report = Report("fault-storm", Budget(seconds=shape.seconds, requests=shape.requests))
    report.data_dir = root
    storm = Storm(root, shape, seed, report)
    await storm.run()
    judge(storm)
    return report
