"""What the fault storm records, and the processes and clients it drives.

A ``Run`` is one planned execution with its readers (SSE clients, each following the
stream to its end through whichever replica is up) and its answers (resumes and
cancels); a ``Fault`` is one injected fault with when it was in effect. ``Replicas``
keeps two Flowcast processes in slots and replaces a killed or stopped one by a fresh
process on a new port; every request through its clients is counted.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from stress.fault_plan import BIG_INPUT_BYTES, GRACE_SECONDS, WORKFLOW_OF, Plan
from stress.harness import BudgetExceeded, Report, clock, counting
from tests.support import faults
from tests.support.logcheck import TERMINAL
from tests.support.servers import FlowcastServer
from tests.support.sse import Frame, events

SSE = {"Accept": "text/event-stream"}
Request = tuple[str, str, Any]  # method, path, JSON body


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
    owned: list[str] = field(default_factory=list)  # a replica fault: what its target ran


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

    async def follow(
        self, run: Run, replicas: Replicas, report: Report, request: Request | None = None
    ) -> None:
        """Read to the end (terminal, 204 or 404), reconnecting to any replica that is up;
        ``request`` (a streaming execute) starts the execution on the first connection."""
        try:
            await self._read_to_the_end(run, replicas, report, request)
        except BudgetExceeded as exc:
            report.find(str(exc))
            self.end("request budget")
            run.started.set()

    async def _read_to_the_end(
        self, run: Run, replicas: Replicas, report: Report, request: Request | None
    ) -> None:
        deadline = clock() + 15  # for the streaming execute to be answered at all
        while not self.ended:
            starting = request is not None and not run.execution_id
            if starting and clock() > deadline:
                self.end("never started")
                run.started.set()
                return
            prefer = self.slot if self.connections == 0 or starting else None
            slot = replicas.pick(self.rng, prefer=prefer)
            if slot is None:
                await asyncio.sleep(0.1)
                continue
            limit = None
            if self.bites > 0:
                self.bites -= 1
                limit = self.rng.randint(3, 40)
            again = await self._connect(run, slot, report, request if starting else None, limit)
            if again:
                await asyncio.sleep(0.2 + 0.2 * self.rng.random())  # EventSource's retry
            elif limit is not None:
                await asyncio.sleep(0.3 * self.rng.random())

    async def _connect(
        self, run: Run, slot: Slot, report: Report, request: Request | None, limit: int | None
    ) -> bool:
        """One connection; True when it should reconnect."""
        if self.frames and self.frames[-1].id is None:
            self.frames.pop()  # cut right after a gap frame: the same cursor gets it again
            self.stamps.pop()
        if request is None:
            method, url, body = "GET", f"/api/executions/{run.execution_id}/stream", None
            headers = {**SSE, "Last-Event-ID": str(self.cursor)}
        else:
            (method, url, body), headers = request, dict(SSE)
        self.connections += 1
        report.connections += 1
        sent = time.time()
        try:
            async with slot.client.stream(method, url, headers=headers, json=body) as response:
                status = response.status_code
                self.statuses[status] += 1
                if request is not None:
                    if status != 200:
                        await response.aread()
                        return True
                    run.accept(response.headers["x-execution-id"], sent, slot.server.port)
                if status in (204, 404):
                    self.end(str(status))
                    return False
                if status != 200:
                    await response.aread()
                    if status >= 500:
                        return True
                    self.end(f"answered {status}: {response.text[:120]}")
                    return False
                return await self._read(run, response, report, limit)
        except httpx.TransportError:
            self.transport_errors += 1
            return True
        except AssertionError:  # the stream ended inside a frame (a process was killed)
            self.broken_frames += 1
            return True

    async def _read(
        self, run: Run, response: httpx.Response, report: Report, limit: int | None
    ) -> bool:
        taken = 0
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as timer:
                async for frame in events(response):
                    if self.ended:
                        self.late_frames.append(frame)
                        continue
                    self.frames.append(frame)
                    self.stamps.append(time.time())
                    report.frames += 1
                    if frame.id is None:
                        continue
                    taken += 1
                    run.saw(frame)
                    if frame.event in TERMINAL:
                        self.end("terminal")  # read on: the server must close right after
                        timer.reschedule(loop.time() + 3)
                    elif limit is not None and taken >= limit:
                        return False
        except TimeoutError:
            self.kept_open = True
        return not self.ended


@dataclass
class Run:
    """One planned execution and everything about it."""

    plan: Plan
    execution_id: str = ""
    sent_wall: float = 0.0
    accepted_wall: float = 0.0
    port: int = 0  # of the process that accepted it
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

    def accept(self, execution_id: str, sent_wall: float, port: int) -> None:
        self.execution_id, self.sent_wall, self.accepted_wall = execution_id, sent_wall, time.time()
        self.port = port
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
        self.exited: dict[int, float] = {}  # port: when its process was gone (wall clock)

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

        count = counting(report)

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
        self.exited[slot.server.port] = time.time()
        await asyncio.sleep(pause)
        await self._replace(slot)

    async def terminate(self, index: int) -> None:
        slot = self.slots[index]
        slot.state = "draining"
        self.draining_ports.add(slot.server.port)
        await faults.terminate_replica(slot.server, timeout=GRACE_SECONDS + 15)
        self.exited[slot.server.port] = time.time()
        slot.state = "down"
        await self._replace(slot)

    async def _replace(self, slot: Slot) -> None:
        server = await faults.fresh_replica(slot.server)
        self.servers.append(server)
        slot.server, slot.client, slot.state = server, self._client(server), "up"

    async def close(self) -> None:
        """SIGTERM the replicas; one that has not exited a few seconds past its grace is
        SIGKILLed and reported, never left running (nothing runs on it by now)."""

        async def stop(slot: Slot) -> None:
            if slot.state != "up":  # stopped, or stopping under a fault of its own
                return
            port = slot.server.port
            try:
                await faults.terminate_replica(slot.server, timeout=GRACE_SECONDS + 8)
            except TimeoutError as exc:
                self._report.find(f"replica on port {port} did not exit after SIGTERM: {exc}")

        await asyncio.gather(*(stop(slot) for slot in self.slots))
        await asyncio.gather(*(client.aclose() for client in self.clients))
