"""The recovery storm: owners SIGKILLed and a rolling restart under a steady load
(SPEC §4 ids and cursor, §7 "Recovery" and "Shutdown hands work off").

Three Flowcast replicas (lease 1 s, shutdown grace 1 s, ``FLOWCAST_MAX_RECOVERIES``
10) share one Valkey with AOF. Executions of three multi-block workflows (a chain, a
fan-out joined again, a row of delays: ``transform``, ``delay`` and ``generate``
blocks, 2-3 s each) start at a steady rate on random replicas, a quarter of them by a
streaming execute; each is followed by one or two SSE clients on random replicas that
reconnect with ``Last-Event-ID`` to another replica when theirs dies. Meanwhile, on the
``Shape``'s timeline: SIGKILL of the replica that owns the most running executions
(read from Valkey), either at once or the moment it answers its next execute with a
202, replaced right after by a fresh process on its data directory; and a rolling
restart: SIGTERM each replica in turn (it drains and hands its executions off), start a
fresh one, wait until it serves, then the next. What each lost replica ran is read
from Valkey as it dies (a SIGKILL) or before its SIGTERM.

Once every client has its terminal event, each execution must have ended
``completed`` with a stored log that passes ``check_log`` (ids 1..N, one terminal,
last); every client's view equals the stored log (no duplicate, no hole, no gap); each
block completed exactly once and ran again only after a recovery; each
``execution:recovered`` is consistent (``stress/recoveries.py``); the output of the
last block still carries the first block's output through every move. Each execution
the lost replica ran has an ``execution:recovered`` after the signal (``worker_lost``
for a SIGKILL, ``handoff`` for a SIGTERM, unless it ended on the draining replica)
within lease + grace + 3 s. No 5xx but a draining replica's 503, no error line or
traceback in any server's log, and a reconnect at the terminal id gets 204.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from stress.fault_records import Replicas, Slot
from stress.harness import (
    SSE,
    Budget,
    Report,
    View,
    bounded,
    clock,
    read_once,
    server_errors,
    stored_log,
    verify,
    wait_terminal,
)
from stress.recoveries import (
    move_problem,
    recoveries,
    recovery_problems,
    running_owners,
    stamp,
    work_problems,
)
from stress.workflows import words
from tests.support.logcheck import check_log
from tests.support.servers import ValkeyServer
from tests.support.sse import Frame

REPLICAS = 3
LEASE_SECONDS = 1.0
GRACE_SECONDS = 1.0
MAX_RECOVERIES = 10
MOVED_SECONDS = LEASE_SECONDS + GRACE_SECONDS + 3.0  # signal to execution:recovered
FOLLOW_SECONDS = 60.0  # a client that has no terminal event by then is stuck


@dataclass(frozen=True)
class Shape:
    """How much load, and when the replicas are lost (fractions of the window)."""

    window: float  # executions start during this many seconds
    interval: float  # one every this many seconds
    kills: tuple[float, ...]  # between two starts: whatever runs then
    accept_kills: tuple[float, ...]  # the moment the busiest replica answers a 202
    rolls: tuple[float, ...]
    seconds: float  # the budget of the load and its ends

    @property
    def executions(self) -> int:
        return int(self.window / self.interval)


# The rolling restart takes about 4 s a replica (a 1 s drain, a fresh start that serves).
# Every short kill waits for a 202: the busiest replica dies right as it accepts an
# execution, and with whatever else it runs at that moment.
SHORT = Shape(
    window=26, interval=0.12, kills=(), accept_kills=(0.1, 0.2, 0.3, 0.9), rolls=(0.4,), seconds=75
)
LONG = Shape(
    window=150,
    interval=0.1,
    kills=tuple(k / 20 for k in range(1, 20, 2) if k not in (7, 15)),
    accept_kills=tuple(k / 20 for k in range(2, 20, 2) if k not in (6, 14)),
    rolls=(0.3, 0.7),
    seconds=300,
)


# -- the workflows ---------------------------------------------------------------------


def recovery_workflows() -> list[dict[str, Any]]:
    """A chain, a fan-out joined again, and a row of delays; each ends with a block that
    echoes the output of its first, so a move that lost a checkpoint shows."""
    intro = {"id": "intro", "type": "transform", "config": {"value": {"n": "{{ input.n }}"}}}
    chain = {
        "id": "rs-chain",
        "blocks": [
            intro,
            {"id": "wait", "type": "delay", "config": {"ms": 600}},
            generate("talk", words(16, "c"), 16),
            {"id": "rest", "type": "delay", "config": {"ms": 300}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.intro.output }}"}},
        ],
        "edges": edges(["intro", "wait", "talk", "rest", "done"]),
    }
    branches = [
        {"id": "d1", "type": "delay", "config": {"ms": 500}},
        generate("g1", words(10, "g1"), 10),
        {"id": "d2", "type": "delay", "config": {"ms": 1100}},
        generate("g2", words(6, "g2"), 0),
    ]
    fan = {
        "id": "rs-fan",
        "blocks": [
            intro,
            *branches,
            {"id": "join", "type": "delay", "config": {"ms": 300}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.intro.output }}"}},
        ],
        "edges": [
            *({"from": "intro", "to": branch["id"]} for branch in branches),
            *({"from": branch["id"], "to": "join"} for branch in branches),
            {"from": "join", "to": "done"},
        ],
    }
    steps = [f"s{index}" for index in range(6)]
    row = {
        "id": "rs-steps",
        "blocks": [
            intro,
            *({"id": step, "type": "delay", "config": {"ms": 350}} for step in steps),
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.intro.output }}"}},
        ],
        "edges": edges(["intro", *steps, "done"]),
    }
    return [chain, fan, row]


def generate(block_id: str, text: str, tokens_per_second: float) -> dict[str, Any]:
    config = {"text": text, "tokensPerSecond": tokens_per_second}
    return {"id": block_id, "type": "generate", "config": config}


def edges(chain: list[str]) -> list[dict[str, str]]:
    return [{"from": a, "to": b} for a, b in pairwise(chain)]


# -- what the storm records ------------------------------------------------------------


@dataclass
class Execution:
    """One execution of the load and its clients."""

    number: int
    workflow: dict[str, Any]
    execution_id: str = ""
    port: int = 0  # of the process that accepted it
    views: list[View] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)  # its id is known
    log: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Loss:
    """One replica lost: SIGKILLed or SIGTERMed, and what it was running then."""

    kind: str  # kill, term
    port: int
    owned: list[str]
    at: float = 0.0  # seconds into the load
    signalled_wall: float = 0.0
    exited_wall: float = 0.0
    at_accept: bool = False  # a kill the moment the replica answered a 202
    accepted: str = ""  # the execution of that 202
    signalled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def label(self) -> str:
        kind = "kill+202" if self.at_accept else self.kind
        return f"{kind}@{self.at:.1f}({len(self.owned)})"


class RecoveryStorm:
    """Runs the load and the replica losses, then checks every execution."""

    def __init__(self, root: Path, shape: Shape, seed: int, report: Report) -> None:
        self.root = root
        self.shape = shape
        self.report = report
        self.rng = random.Random(seed)
        self.valkey = ValkeyServer(data_dir=root / "valkey")
        self.workflows = recovery_workflows()
        self.executions: list[Execution] = []
        self.losses: list[Loss] = []
        self.broken_on_live: list[str] = []
        self.began = 0.0
        self._live: Replicas | None = None
        self._trap: Loss | None = None  # a kill waiting for its replica's next 202

    @property
    def live(self) -> Replicas:
        assert self._live is not None
        return self._live

    def env(self) -> dict[str, str]:
        directory = self.root / "workflows"
        directory.mkdir(parents=True, exist_ok=True)
        for workflow in self.workflows:
            (directory / f"{workflow['id']}.json").write_text(json.dumps(workflow))
        return {
            "FLOWCAST_REDIS_URL": self.valkey.url,
            "FLOWCAST_WORKFLOWS_DIR": str(directory),
            "FLOWCAST_LEASE_SECONDS": str(LEASE_SECONDS),
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": str(GRACE_SECONDS),
            "FLOWCAST_MAX_RECOVERIES": str(MAX_RECOVERIES),
            "FLOWCAST_SSE_PING_SECONDS": "1",
            "FLOWCAST_LOG_LEVEL": "warning",
        }

    async def run(self) -> None:
        await self.valkey.start()
        self._live = Replicas(self.root, self.env(), self.report)
        try:
            await self.live.start(REPLICAS)
            await bounded(self.report, self._load())
            await self._collect()
        finally:
            try:
                await self.live.close()
            finally:
                await self.valkey.stop()

    # -- the load --------------------------------------------------------------------

    async def _load(self) -> None:
        self.began = clock()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._chaos())
            for number in range(self.shape.executions):
                execution = Execution(number, self.rng.choice(self.workflows))
                self.executions.append(execution)
                group.create_task(self._drive(execution, random.Random(self.rng.random())))

    async def _drive(self, execution: Execution, rng: random.Random) -> None:
        """Start the execution at its time and follow it with one or two clients."""
        await asyncio.sleep(max(0.0, self.began + execution.number * self.shape.interval - clock()))
        body = {"input": {"n": execution.number}}
        streaming = rng.random() < 0.25
        async with asyncio.TaskGroup() as group:
            if streaming:
                view = View("")
                execution.views.append(view)
                request = ("POST", f"/api/workflows/{execution.workflow['id']}/execute", body)
                group.create_task(self._follow(execution, view, rng, request=request))
                await execution.started.wait()
            elif not await self._start(execution, body, rng):
                return
            if not execution.execution_id:
                return
            for _ in range(1 if streaming else rng.choice((1, 2))):
                view = View(execution.execution_id)
                execution.views.append(view)
                group.create_task(self._follow(execution, view, rng, wait=rng.uniform(0, 1.5)))

    async def _start(self, execution: Execution, body: dict[str, Any], rng: random.Random) -> bool:
        """POST execute on a random replica, on another after a 503 or no answer."""
        url = f"/api/workflows/{execution.workflow['id']}/execute"
        deadline = clock() + 15
        while clock() < deadline:
            slot = self.live.pick(rng)
            if slot is None:
                await asyncio.sleep(0.1)
                continue
            try:
                response = await slot.client.post(url, json=body)
            except httpx.TransportError:
                await asyncio.sleep(0.1)
                continue
            if response.status_code == 202:
                execution.execution_id = response.json()["executionId"]
                execution.port = slot.server.port
                execution.started.set()
                self._spring(slot, execution)
                return True
            if response.status_code != 503:
                self.report.find(f"execute answered {response.status_code}: {response.text[:200]}")
                return False
            await asyncio.sleep(0.1)
        self.report.find(f"execution {execution.number}: no replica accepted it in 15 s")
        return False

    async def _follow(
        self,
        execution: Execution,
        view: View,
        rng: random.Random,
        *,
        request: tuple[str, str, Any] | None = None,
        wait: float = 0.0,
    ) -> None:
        """Read the stream to its terminal event through whichever replicas are up;
        ``request`` (a streaming execute) starts the execution on the first connection
        that answers."""
        await asyncio.sleep(wait)
        try:
            async with asyncio.timeout(FOLLOW_SECONDS):
                while not view.finished and not view.stuck:
                    slot = self.live.pick(rng)
                    if slot is None:
                        await asyncio.sleep(0.1)
                        continue
                    starting = request is not None and not view.execution_id
                    again = await self._connect(
                        execution, slot, view, request if starting else None
                    )
                    if again:
                        await asyncio.sleep(rng.uniform(0.1, 0.3))  # EventSource's retry
        except TimeoutError:
            view.stuck = True
        finally:
            if request is not None and not execution.started.is_set():
                self.report.find(f"execution {execution.number}: the streaming execute never began")
                execution.started.set()

    async def _connect(
        self,
        execution: Execution,
        slot: Slot,
        view: View,
        request: tuple[str, str, Any] | None,
    ) -> bool:
        """One connection; True to reconnect after a pause. A stream that breaks or ends
        early on a replica that is still up and not draining is a finding."""
        server, frames = slot.server, len(view.frames)

        def started(frame: Frame) -> None:
            # The streaming execute that created it may have been cut before its first
            # event (its replica killed): the execution still began, and its first
            # event arrives on a later connection.
            if view.execution_id and not execution.started.is_set():
                execution.execution_id, execution.port = view.execution_id, server.port
                execution.started.set()

        try:
            again = await read_once(
                slot.client,
                view,
                self.report,
                request=request,
                retry_statuses=(503,),
                on_event=started,
            )
        except AssertionError:  # the stream ended inside a frame: its process died
            again = True
        if view.finished or slot.server is not server or slot.state != "up":
            return again
        if again and len(view.frames) > frames:
            self.broken_on_live.append(f"{view.execution_id} broke at {view.cursor}")
        elif not again and request is None:
            self.broken_on_live.append(f"{view.execution_id} closed at {view.cursor}")
        return again

    # -- the losses ------------------------------------------------------------------

    async def _chaos(self) -> None:
        shape = self.shape
        timeline = sorted(
            [(at, "kill") for at in shape.kills]
            + [(at, "accept") for at in shape.accept_kills]
            + [(at, "roll") for at in shape.rolls]
        )
        for at, kind in timeline:
            # Half an interval off the starts' ticks, so a plain kill does not land on
            # an execute by chance.
            await asyncio.sleep(
                max(0.0, self.began + at * shape.window + shape.interval / 2 - clock())
            )
            await self.live.all_up()
            if kind == "roll":
                for index in range(REPLICAS):
                    await self._stop(index)
            else:
                await self._kill(at_accept=kind == "accept")

    async def _kill(self, *, at_accept: bool) -> None:
        """SIGKILL the replica that owns the most running executions (at once, or the
        moment it answers its next 202), then start a fresh one on its data directory
        and wait until it serves."""
        owners = await self._owners()
        counts = [len(owners.get(slot.server.port, [])) for slot in self.live.slots]
        index = self.rng.choice([n for n, count in enumerate(counts) if count == max(counts)])
        slot = self.live.slots[index]
        loss = Loss("kill", slot.server.port, [], at_accept=at_accept)
        self.losses.append(loss)
        if at_accept:
            self._trap = loss
            try:
                async with asyncio.timeout(3):
                    await loss.signalled.wait()
            except TimeoutError:
                loss.at_accept = False  # no 202 from it in 3 s: a plain kill
            finally:
                self._trap = None
        if not loss.signalled.is_set():
            self._signal(slot, loss)
        loss.at = clock() - self.began
        # Exactly what it held as it died: none of its leases can run out this soon.
        loss.owned = (await self._owners()).get(loss.port, [])
        await self.live.kill(index, 0.0)  # reaps it, and starts the fresh one
        loss.exited_wall = self.live.exited[loss.port]

    def _spring(self, slot: Slot, execution: Execution) -> None:
        """SIGKILL the process that just answered this 202, if a kill waits for it: SPEC
        §7 holds for a process dying at any instant, this one included."""
        loss = self._trap
        if loss is None or loss.port != slot.server.port or loss.signalled.is_set():
            return
        self._signal(slot, loss)
        loss.accepted = execution.execution_id

    def _signal(self, slot: Slot, loss: Loss) -> None:
        slot.state = "down"  # no client picks it from now on
        os.kill(slot.server.pid, signal.SIGKILL)
        loss.signalled_wall = time.time()
        loss.signalled.set()

    async def _stop(self, index: int) -> None:
        """SIGTERM replica ``index``, wait for its drain and exit, start a fresh one on
        its data directory and wait until it serves."""
        slot = self.live.slots[index]
        owned = (await self._owners()).get(slot.server.port, [])
        loss = Loss("term", slot.server.port, owned, at=clock() - self.began)
        self.losses.append(loss)
        loss.signalled_wall = time.time()
        await self.live.terminate(index)
        loss.exited_wall = self.live.exited[loss.port]

    async def _owners(self) -> dict[int, list[str]]:
        redis = Redis.from_url(self.valkey.url, socket_timeout=5)
        try:
            accepted = {e.execution_id: e.port for e in self.executions if e.execution_id}
            return await running_owners(redis, accepted)
        finally:
            await redis.aclose()

    # -- the ends --------------------------------------------------------------------

    async def _collect(self) -> None:
        """Every execution's end and stored log, through a replica that is up."""
        try:
            async with asyncio.timeout(30):
                await self.live.all_up()
        except TimeoutError:
            self.report.find("a replica was still down 30 s after the load")
        slot = self.live.pick(self.rng)
        if slot is None:
            self.report.find("no replica up after the load: nothing checked")
            return
        deadline = clock() + 30
        for execution in self.executions:
            if not execution.execution_id:
                continue
            left = max(0.1, deadline - clock())
            if await wait_terminal(slot.client, execution.execution_id, deadline=left) is None:
                self.report.find(f"{execution.execution_id}: not terminal 30 s after the load")
            execution.log = await stored_log(slot.client, execution.execution_id)
            self.report.stored_events += len(execution.log)
        ends = await asyncio.gather(
            *(self._at_the_end(view) for e in self.executions for view in e.views)
        )
        self.report.figures["ended_by_204"] = sum(ends)

    async def _at_the_end(self, view: View) -> bool:
        """A reconnect at the terminal id: 204, so EventSource stops."""
        if not view.finished:
            return False
        slot = self.live.pick(self.rng)
        assert slot is not None
        url = f"/api/executions/{view.execution_id}/stream"
        headers = {**SSE, "Last-Event-ID": str(view.cursor)}
        async with slot.client.stream("GET", url, headers=headers) as response:
            if response.status_code != 204:
                self.report.find(f"{view.execution_id}: {response.status_code} at the terminal id")
            return response.status_code == 204

    # -- the verdict -----------------------------------------------------------------

    def judge(self) -> None:
        report = self.report
        started = [e for e in self.executions if e.execution_id]
        for execution in started:
            self._judge_execution(execution)
        for loss in self.losses:
            self._judge_loss(loss, {e.execution_id: e for e in started})
        for problem in self.broken_on_live:
            report.find(f"stream broken on a replica that was up: {problem}")
        for error in self.live.errors:
            if not (error.status == 503 and error.port in self.live.draining_ports):
                report.find(f"{error.status} from {error.method} {error.path}: {error.body}")
        errors = [line for server in self.live.servers for line in server_errors(server.logs())]
        report.figures["server_errors"] = len(errors)
        for line in errors:
            report.find(f"error line in a server log: {line}")
        moves = Counter(event["data"]["reason"] for e in started for event in recoveries(e.log))
        views = [view for e in started for view in e.views]
        report.executions = len(started)
        report.figures.update(
            kills=sum(loss.kind == "kill" for loss in self.losses),
            stops=sum(loss.kind == "term" for loss in self.losses),
            # what, when (s into the load), and how many executions ran on the replica
            losses=" ".join(loss.label for loss in self.losses),
            recoveries=moves["worker_lost"],
            handoffs=moves["handoff"],
            rerun_blocks=sum(
                len(event["data"]["rerun"]) for e in started for event in recoveries(e.log)
            ),
            reconnects=sum(view.connections - 1 for view in views),
            **self._latencies(started),
        )

    def _judge_execution(self, execution: Execution) -> None:
        log, eid = execution.log, execution.execution_id
        try:
            check_log(log)
        except AssertionError as exc:
            head = ", ".join(f"{e['id']} {e['type']}" for e in log[:2])
            detail = "" if str(exc).startswith("{") else f": {exc}"  # not the envelope again
            why = self._losses_of(eid)
            self.report.find(f"{eid}: stored log ({head}, …) fails check_log{detail}{why}")
        else:
            verify(self.report, log, execution.views)
        if not log:
            return
        end = log[-1]
        if end["type"] != "execution:completed":
            code = end["data"].get("error", {}).get("code", "")
            why = self._losses_of(eid)
            self.report.find(f"{eid}: ended {end['type']} {code} at id {end['id']}{why}")
            return
        for problem in work_problems(log, execution.workflow) + recovery_problems(log):
            self.report.find(f"{eid} ({execution.workflow['id']}): {problem}")
        intro = next(e for e in log if e["type"] == "block:completed")["data"]["output"]
        if intro != {"n": execution.number} or end["data"]["output"] != {"done": intro}:
            self.report.find(f"{eid}: intro {intro}, output {end['data']['output']}")

    def _losses_of(self, execution_id: str) -> str:
        """Which replica losses it ran through, for a finding."""
        if any(loss.accepted == execution_id for loss in self.losses):
            return "; its replica was SIGKILLed right as it answered the execute's 202"
        kinds = [loss.kind for loss in self.losses if execution_id in loss.owned]
        return f"; running on a replica at its {' and '.join(kinds)}" if kinds else ""

    def _judge_loss(self, loss: Loss, by_id: dict[str, Execution]) -> None:
        """Each execution the lost replica ran ended first, or moved: a ``worker_lost``
        recovery after a SIGKILL, a ``handoff`` after a SIGTERM (or it ended on the
        draining replica), within ``MOVED_SECONDS`` of the signal."""
        for execution_id in loss.owned:
            problem = move_problem(
                by_id[execution_id].log,
                kind=loss.kind,
                signalled_wall=loss.signalled_wall,
                exited_wall=loss.exited_wall,
                within=MOVED_SECONDS,
            )
            if problem:
                where = f"{execution_id}, running on port {loss.port} at its {loss.kind}"
                self.report.find(f"{where}: {problem}")

    def _latencies(self, started: list[Execution]) -> dict[str, float]:
        """From each signal to the execution:recovered of each execution it moved."""
        by_id = {e.execution_id: e for e in started}
        seconds: dict[str, list[float]] = {"kill": [], "term": []}
        for loss in self.losses:
            for execution_id in loss.owned:
                moved = [
                    stamp(e) - loss.signalled_wall
                    for e in recoveries(by_id[execution_id].log)
                    if stamp(e) > loss.signalled_wall
                ]
                if moved:
                    seconds[loss.kind].append(moved[0])
        figures = {}
        for kind, name in (("kill", "recovered"), ("term", "handed_off")):
            if seconds[kind]:
                figures[f"{name}_p50_s"] = round(statistics.median(seconds[kind]), 2)
                figures[f"{name}_max_s"] = round(max(seconds[kind]), 2)
        return figures


async def recovery_storm(root: Path, *, long: bool = False, seed: int = 20261129) -> Report:
    """Owners SIGKILLed and a rolling restart under load; see the module docstring."""
    shape = LONG if long else SHORT
    requests = shape.executions * 15 + 500
    report = Report("recovery-storm", Budget(seconds=shape.seconds, requests=requests))
    report.data_dir = root
    storm = RecoveryStorm(root, shape, seed, report)
    await storm.run()
    storm.judge()
    return report
