"""The mass reconnect storm: thousands of SSE clients dropped at one instant, all
reconnecting at once with ``Last-Event-ID`` (SPEC §4: ids, cursor, gaps, end).

Two Flowcast replicas (listen backlog 8192, no per-tenant stream cap) share one Valkey
with AOF and run ``Plan.executions`` executions, started on both, of a ``generate`` block
(``Plan.chunks`` tokens at ``Plan.tokens_per_second``) followed by an ``approval`` that
holds each execution until the storm is over, so that every round drops every client
however long the reopening takes. ``Plan.clients`` SSE clients, spread over a few
raw-asyncio client processes (``stress/mass_client.py``: httpx cannot hold thousands of
streams in one process), attach from id 0, client i to execution i mod executions, each
connection to a random replica. Then, ``Plan.rounds`` times: at one wall-clock instant
every client process closes all its streams, in one pass of its loop, and all its
clients reconnect at once with ``Last-Event-ID`` = the last id they received, each to a
random replica; between two rounds the events flow for ``Plan.pause`` seconds. Then
every execution is resumed (through a random replica) once it has paused, every client
reads on to its terminal event, and reconnects once more at the terminal id.

The rules, each a finding:

- every client's whole view (from id 0, over all its connections) passes ``verify``
  against the execution's stored log, read through every page of ``/events``: ids in
  order, each once, equal to the stored events, the terminal event last; no
  ``replay:gap`` at all (nothing is evicted or dropped in this run, so a gap is a lost
  event); each execution completed, every block once, the chunks joined to the text
  (``check_work``);
- no stream ends before its terminal event unless the storm dropped it, none stays open
  5 s after it, nothing comes after it, and a reconnect at the terminal id gets 204;
- every resume of a paused execution gets 202; no 5xx, no error line in a server's log.

A connection that gets no answer (refused, reset before its headers, not answered within
60 s) is tried again after 0.1 s, as EventSource does, and counted in
``connect_retries``; a client that never gets through is stuck, a finding.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.report import percentile
from bench.scale import Worker, raise_nofile, split, tree_cpu, workers
from stress.harness import (
    TERMINAL_STATUSES,
    Budget,
    Report,
    View,
    bounded,
    stack,
    stored_log,
    verify,
)
from stress.workflows import check_work, held_streaming_workflow
from tests.support.sse import Frame

CLIENTS = 5_000  # ``python -m stress.run``; ``--long`` doubles it
BACKLOG = 8192  # per replica; the kernel caps it at net.core.somaxconn
OPEN_TIMEOUT = 60.0  # a connection not answered by then is tried again
CLIENTS_PER_PROCESS = 1_250
PAGE = 250  # client views per ``collect`` answer: bounded lines on the pipe


@dataclass(frozen=True)
class Plan:
    """How many clients on how many executions, and how many storms."""

    clients: int
    executions: int
    rounds: int
    tokens_per_second: float = 2.0
    pause: float = 1.5  # seconds of live events before each round

    @property
    def processes(self) -> int:
        return min(8, max(2, math.ceil(self.clients / CLIENTS_PER_PROCESS)))

    @property
    def reopen_estimate(self) -> float:
        """Seconds until all clients are open again after a drop, about, on this 2-CPU VM
        (1.2 s for 1,000, 5-14 s for 5,000): it grows faster than the clients."""
        thousands = self.clients / 1000
        return thousands * (1 + thousands / 5)

    @property
    def chunks(self) -> int:
        """Enough to stream through the attach and every round (the approval after the
        ``generate`` holds the execution if the rounds take longer)."""
        seconds = self.reopen_estimate + self.rounds * (self.pause + self.reopen_estimate) + 2
        return math.ceil(seconds * self.tokens_per_second)

    @property
    def streaming_seconds(self) -> float:
        return self.chunks / self.tokens_per_second

    @property
    def connections(self) -> int:
        """At most this many connections per client: attach, the rounds, the 204 at the
        end, and a few reconnects after a stream broke or a 5xx."""
        return self.rounds + 10


def plan(clients: int | None, long: bool) -> Plan:
    """5,000 clients (``--long``: 10,000, one round more), one execution per 50 of them,
    at least 50 and at most 200."""
    count = clients or (2 * CLIENTS if long else CLIENTS)
    return Plan(clients=count, executions=min(200, max(50, count // 50)), rounds=4 if long else 3)


async def mass_reconnect(
    root: Path, *, long: bool = False, seed: int = 20261129, clients: int | None = None
) -> Report:
    """``clients`` SSE clients (5,000 by default) on streaming executions, all dropped at
    one instant and reconnecting at once with Last-Event-ID, round after round."""
    shape = plan(clients, long)
    report = Report(
        "mass-reconnect",
        Budget(
            seconds=300 + 4 * shape.rounds * shape.reopen_estimate,
            requests=shape.clients * shape.connections + shape.executions * 60 + 50,
        ),
    )
    workflow = held_streaming_workflow(
        "mass-reconnect", count=shape.chunks, tokens_per_second=shape.tokens_per_second
    )
    report.figures |= {"clients": shape.clients, "executions": shape.executions}
    raise_nofile()  # the replicas inherit it: each holds thousands of sockets
    env = {"FLOWCAST_MAX_STREAMS_PER_TENANT": "0", "FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "0"}
    async with (
        stack(root, report, env=env, backlog=BACKLOG, connections=32) as running,
        workers(shape.processes, root, "mass", module="stress.mass_client") as procs,
    ):
        storm = Storm(shape, report, procs, running.clients, seed)
        cpu = [tree_cpu(server.pid) for server in running.servers]
        await bounded(report, storm.run(workflow, [server.port for server in running.servers]))
        report.figures["server_cpu_seconds"] = [
            round(tree_cpu(server.pid) - before, 1)
            for server, before in zip(running.servers, cpu, strict=True)
        ]
        if not storm.completed:
            # A client process may still be answering the command the budget cut short:
            # its next answers would not match, and the budget's finding says enough.
            return report
        views = await storm.collect()
        await check(report, storm, views, workflow)
    ended = report.figures["ended_by_204"] = sum(view.no_content for view in views)
    if ended != shape.clients:
        report.find(f"{ended} of {shape.clients} clients got 204 at their terminal id")
    return report


async def check(report: Report, storm: Storm, views: list[View], workflow: dict[str, Any]) -> None:
    """Every view against its execution's stored log; how many executions were still
    streaming their chunks at each round's drop."""
    began = time.perf_counter()
    gate = asyncio.Semaphore(16)

    async def read(execution_id: str) -> list[dict[str, Any]]:
        async with gate:
            return await stored_log(storm.rng.choice(storm.http), execution_id)

    by_execution: dict[str, list[View]] = {}
    for view in views:
        by_execution.setdefault(view.execution_id, []).append(view)
    logs = await asyncio.gather(*(read(execution_id) for execution_id in by_execution))
    streamed: list[float] = []  # when each execution's generate completed
    for log, group in zip(logs, by_execution.values(), strict=True):
        report.stored_events += len(log)
        verify(report, log, group)
        check_work(report, log, workflow)
        streamed += [
            datetime.fromisoformat(e["ts"]).timestamp()
            for e in log
            if e["type"] == "block:completed" and e["data"]["blockId"] == "talk"
        ]
    report.executions = len(by_execution)
    report.figures["streaming_at_drop"] = [
        sum(1 for end in streamed if end > at) for at in storm.drops
    ]
    report.figures["gaps"] = sum(
        frame.event == "replay:gap" for view in views for frame in view.frames
    )
    report.figures["check_seconds"] = round(time.perf_counter() - began, 1)


class Storm:
    """The client processes of one storm, driven round by round."""

    def __init__(
        self,
        shape: Plan,
        report: Report,
        procs: list[Worker],
        http: list[httpx.AsyncClient],
        seed: int,
    ) -> None:
        self.shape = shape
        self.report = report
        self.procs = procs
        self.http = http
        self.seed = seed
        self.rng = random.Random(seed)
        self.execution_ids: list[str] = []
        self.drops: list[float] = []  # the wall time of each round's drop
        self.completed = False  # every command answered: the processes are in step

    async def ask_all(self, commands: list[dict[str, Any]], timeout: float) -> list[Any]:
        return list(
            await asyncio.gather(
                *(
                    proc.ask(command, timeout=timeout)
                    for proc, command in zip(self.procs, commands, strict=True)
                )
            )
        )

    async def tell_all(self, command: dict[str, Any], timeout: float) -> list[Any]:
        return await self.ask_all([command] * len(self.procs), timeout)

    async def run(self, workflow: dict[str, Any], ports: list[int]) -> None:
        await self.start(workflow)
        await self.attach(ports)
        for number in range(self.shape.rounds):
            # The load's schedule, not a readiness wait: events flow to every client
            # before the next instant at which all of them are dropped.
            await asyncio.sleep(self.shape.pause)
            await self.drop(number)
        await self.release()
        # Every generate has ended and every execution is resumed: the ends are due.
        began = time.time()
        answers = await self.tell_all({"cmd": "finish", "timeout": 90}, timeout=120)
        self.report.figures["to_end_seconds"] = round(
            max(answer["settled"] for answer in answers) - began, 2
        )
        self.report.figures["stuck"] = sum(answer["stuck"] for answer in answers)
        await self.tell_all({"cmd": "end", "timeout": OPEN_TIMEOUT}, timeout=OPEN_TIMEOUT + 30)
        self.completed = True

    async def start(self, workflow: dict[str, Any]) -> None:
        """Store the workflow and start the executions, alternately on each replica."""
        response = await self.http[0].put(f"/api/workflows/{workflow['id']}", json=workflow)
        response.raise_for_status()
        gate = asyncio.Semaphore(32)

        async def one(number: int) -> str:
            async with gate:
                response = await self.http[number % len(self.http)].post(
                    f"/api/workflows/{workflow['id']}/execute", json={"input": {"n": number}}
                )
            if response.status_code != 202:
                raise AssertionError(f"execute answered {response.status_code}: {response.text}")
            execution_id: str = response.json()["executionId"]
            return execution_id

        self.execution_ids = list(
            await asyncio.gather(*(one(n) for n in range(self.shape.executions)))
        )

    async def attach(self, ports: list[int]) -> None:
        """Every client opens its stream from id 0, all at once."""
        ids = self.execution_ids
        targets = [[ids[n % len(ids)], 0] for n in range(self.shape.clients)]
        began = time.time()
        answers = await self.ask_all(
            [
                {
                    "cmd": "attach",
                    "clients": share,
                    "ports": ports,
                    "seed": self.seed + index,
                    "maxConnections": self.shape.connections,
                    "timeout": OPEN_TIMEOUT,
                }
                for index, share in enumerate(split(targets, len(self.procs)))
            ],
            timeout=OPEN_TIMEOUT + 30,
        )
        opened = opening(answers, began)
        self.report.figures["attach_seconds"] = opened["max"]
        print(f"  mass-reconnect attach: {opened}", flush=True)

    async def drop(self, number: int) -> None:
        """One round: every stream closed at one instant, every client reconnecting."""
        at = time.time() + 0.2  # every process has its command by then
        self.drops.append(at)
        answers = await self.tell_all(
            {"cmd": "storm", "at": at, "timeout": OPEN_TIMEOUT}, timeout=OPEN_TIMEOUT + 30
        )
        figures = self.report.figures
        dropped = sum(answer["dropped"] for answer in answers)
        opened = opening(answers, at)
        figures.setdefault("dropped", []).append(dropped)
        figures.setdefault("reopen_seconds", []).append(opened["max"])
        figures.setdefault("reopen_p50_seconds", []).append(opened["p50"])
        figures.setdefault("round_seconds", []).append(round(time.time() - at, 2))
        print(
            f"  mass-reconnect round {number + 1}: {dropped} streams dropped at once; "
            f"reconnected {opened}",
            flush=True,
        )

    async def release(self) -> None:
        """Resume every execution, once paused, through a random replica."""
        gate = asyncio.Semaphore(16)
        codes: Counter[int] = Counter()

        async def one(execution_id: str) -> None:
            async with gate:
                status = await self.paused(execution_id)
                if status != "paused":
                    if status not in TERMINAL_STATUSES:  # an end is check_work's finding
                        self.report.find(f"{execution_id}: {status} at the end, not paused")
                    return
                response = await self.rng.choice(self.http).post(
                    f"/api/executions/{execution_id}/resume", json={"input": {"approved": True}}
                )
            codes[response.status_code] += 1
            if response.status_code != 202:
                self.report.find(f"{execution_id}: resume answered {response.status_code}")

        began = time.perf_counter()
        await asyncio.gather(*(one(execution_id) for execution_id in self.execution_ids))
        self.report.figures["release_seconds"] = round(time.perf_counter() - began, 2)

    async def paused(self, execution_id: str) -> str:
        """Poll the snapshot until the execution waits at its approval or has ended; its
        status then, or the last one seen a minute after its ``generate`` should have
        ended."""
        status = "unknown"
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.shape.streaming_seconds + 60):
                while True:
                    client = self.rng.choice(self.http)
                    response = await client.get(f"/api/executions/{execution_id}")
                    if response.status_code == 200:
                        status = str(response.json()["status"])
                        if status == "paused" or status in TERMINAL_STATUSES:
                            return status
                    await asyncio.sleep(0.1)
        return status

    async def collect(self) -> list[View]:
        """Every client's view, and what the client processes counted and saw go wrong."""
        report = self.report
        views: list[View] = []
        problems: Counter[str] = Counter()
        examples: dict[str, str] = {}
        failures: Counter[str] = Counter()
        cpu = []
        for proc in self.procs:
            stats = await proc.ask({"cmd": "stats"}, timeout=30)
            report.statuses.update({int(code): n for code, n in stats["statuses"].items()})
            report.requests += stats["connections"]
            failures.update(stats["failures"])
            cpu.append(round(stats["cpu"], 1))
            offset = 0
            while True:
                page = await proc.ask(
                    {"cmd": "collect", "offset": offset, "limit": PAGE}, timeout=60
                )
                for data in page["views"]:
                    views.append(view_of(data))
                    for kind, detail in data["problems"]:
                        problems[kind] += 1
                        examples.setdefault(kind, detail)
                if len(page["views"]) < PAGE:
                    break
                offset += PAGE
        for view in views:
            report.frames += len(view.frames)
            report.connections += view.connections
        for kind, count in problems.most_common():
            report.find(f"{kind} ({count} times), first: {examples[kind]}")
        if report.requests > report.budget.requests:
            report.find(
                f"{report.name}: {report.requests} requests, budget {report.budget.requests}"
            )
        report.figures["connect_retries"] = sum(failures.values())
        if failures:
            report.figures["connect_failures"] = dict(failures)
        report.figures["client_cpu_seconds"] = cpu
        return views


def view_of(data: dict[str, Any]) -> View:
    """A client process's record of one client as the harness's ``View``."""
    return View(
        data["executionId"],
        start=data["start"],
        frames=[Frame(event=event, id=id, data=text) for id, event, text in data["frames"]],
        connections=data["connections"],
        no_content=data["noContent"],
        finished=not data["stuck"],
        stuck=data["stuck"],
    )


def opening(answers: list[dict[str, Any]], since: float) -> dict[str, Any]:
    """How many streams got their response headers, and when (p50, p99, the last),
    in seconds after ``since``."""
    heads = [head - since for answer in answers for head in answer["heads"]]
    if not heads:
        return {"opened": 0, "p50": None, "p99": None, "max": None}
    return {
        "opened": len(heads),
        "p50": round(percentile(heads, 50), 2),
        "p99": round(percentile(heads, 99), 2),
        "max": round(max(heads), 2),
    }
