"""What every stress scenario shares: real processes, a request budget, SSE followers
and the invariant checks.

A scenario runs its own Valkey (AOF on) and one or two Flowcast processes, each with
its own data directory, drives them through counted ``httpx`` clients, and ends by
checking every execution's stored log and every client's view with the log checker.
A broken invariant is recorded as a finding, not raised, so one run reports them all.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.logcheck import TERMINAL, check_log, check_view
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, events

TERMINAL_STATUSES = ("completed", "failed", "cancelled")
BACKLOG = 2048  # uvicorn's default listen backlog
EXECUTION_ID = re.compile(r"ex_[A-Za-z0-9_-]{24}")
SSE = {"Accept": "text/event-stream"}


class BudgetExceeded(Exception):
    """A scenario sent more requests than its budget allows."""


@dataclass(frozen=True)
class Budget:
    """The bounds of one scenario: wall-clock seconds and HTTP requests."""

    seconds: float
    requests: int


@dataclass
class Report:
    """What one scenario did and what it found."""

    name: str
    budget: Budget
    seconds: float = 0.0
    requests: int = 0
    executions: int = 0
    stored_events: int = 0
    views: int = 0
    connections: int = 0
    frames: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    figures: dict[str, Any] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    data_dir: Path | None = None
    checking: bool = False  # the load is over: the checks' own requests are not bounded
    _kinds: dict[str, int] = field(default_factory=dict, repr=False)
    _counts: list[int] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return not self.findings

    def find(self, message: str) -> None:
        """Record a broken invariant; findings that differ only in the execution id are
        counted under the first one, so a storm of the same failure stays readable."""
        kind = EXECUTION_ID.sub("ex_…", message)
        if kind not in self._kinds:
            self._kinds[kind] = len(self.findings)
            self.findings.append(message[:500])
            self._counts.append(0)
        self._counts[self._kinds[kind]] += 1

    def listing(self) -> list[str]:
        """The findings, each with how often it (or the same for another execution) came."""
        return [
            finding if count == 1 else f"{finding} (x{count})"
            for finding, count in zip(self.findings, self._counts, strict=True)
        ]

    def summary(self) -> str:
        statuses = ", ".join(f"{code}x{count}" for code, count in sorted(self.statuses.items()))
        figures = ", ".join(f"{name}={value}" for name, value in self.figures.items())
        verdict = "ok" if self.ok else f"{len(self.findings)} FINDINGS"
        return (
            f"{self.name}: {verdict} in {self.seconds:.1f}s (budget {self.budget.seconds:.0f}s); "
            f"{self.requests} requests (budget {self.budget.requests}) [{statuses}]; "
            f"{self.executions} executions, {self.stored_events} stored events; "
            f"{self.views} client views, {self.connections} connections, {self.frames} frames"
            + (f"; {figures}" if figures else "")
        )


class BackloggedServer(FlowcastServer):
    """A Flowcast process with a listen backlog of its own (the kernel caps it at
    ``net.core.somaxconn``): thousands of clients connecting at once overflow the default."""

    def __init__(
        self, *, data_dir: Path, env: dict[str, str] | None = None, backlog: int = BACKLOG
    ) -> None:
        super().__init__(data_dir=data_dir, env=env)
        self.backlog = backlog

    def command(self) -> list[str]:
        return [*super().command(), "--backlog", str(self.backlog)]


@dataclass
class Stack:
    """One Valkey, its Flowcast processes, and a counted client per process."""

    valkey: ValkeyServer
    servers: list[FlowcastServer]
    clients: list[httpx.AsyncClient]


def counting(report: Report) -> Callable[[httpx.Request], Awaitable[None]]:
    """An httpx request hook: every request counts against the report's budget."""

    async def count(request: httpx.Request) -> None:
        report.requests += 1
        if report.requests > report.budget.requests and not report.checking:
            raise BudgetExceeded(f"{report.name}: more than {report.budget.requests} requests")

    return count


def judging(
    report: Report, tolerate: Callable[[httpx.Response], bool] = lambda _response: False
) -> Callable[[httpx.Response], Awaitable[None]]:
    """An httpx response hook: statuses are tallied, and a 5xx ``tolerate`` does not
    excuse is a finding."""

    async def judge(response: httpx.Response) -> None:
        report.statuses[response.status_code] += 1
        if response.status_code >= 500 and not tolerate(response):
            await response.aread()
            report.find(
                f"{response.status_code} from {response.request.method} "
                f"{response.request.url.path}: {response.text[:200]}"
            )

    return judge


@asynccontextmanager
async def stack(
    root: Path,
    report: Report,
    *,
    processes: int = 2,
    env: dict[str, str] | None = None,
    connections: int = 100,
    tolerate: Callable[[httpx.Response], bool] = lambda response: False,
    errors_expected: bool = False,
    backlog: int = BACKLOG,
) -> AsyncIterator[Stack]:
    """Start Valkey and ``processes`` Flowcast servers (listening with ``backlog``) under
    ``root``; every request made through the yielded clients counts against the report's
    budget, and every 5xx that ``tolerate`` does not excuse is a finding, as is an error
    line in a server's log unless ``errors_expected``."""
    report.data_dir = root

    count, judge = counting(report), judging(report, tolerate)

    valkey = ValkeyServer(data_dir=root / "valkey")
    await valkey.start()
    servers: list[FlowcastServer] = [
        BackloggedServer(
            data_dir=root / f"server-{index}",
            backlog=backlog,
            env={
                "FLOWCAST_REDIS_URL": valkey.url,
                "FLOWCAST_SSE_PING_SECONDS": "1",
                "FLOWCAST_LOG_LEVEL": "warning",
                **(env or {}),
            },
        )
        for index in range(processes)
    ]
    try:
        await asyncio.gather(*(server.start() for server in servers))
        async with AsyncExitStack() as exits:
            clients = [
                await exits.enter_async_context(
                    httpx.AsyncClient(
                        base_url=server.url,
                        timeout=httpx.Timeout(30, read=15),
                        limits=httpx.Limits(
                            max_connections=connections, max_keepalive_connections=connections
                        ),
                        event_hooks={"request": [count], "response": [judge]},
                    )
                )
                for server in servers
            ]
            yield Stack(valkey, servers, clients)
    finally:
        await asyncio.gather(*(server.stop() for server in servers), return_exceptions=True)
        await valkey.stop()
        errors = [line for server in servers for line in server_errors(server.logs())]
        report.figures["server_errors"] = len(errors)
        if errors and not errors_expected:
            report.find(f"{len(errors)} error lines in the server logs, first: {errors[0]}")


def server_errors(logs: str) -> list[str]:
    """The error lines of a server's JSON log, each as level, path and message."""
    found = []
    for line in logs.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            found.append(line[:200])  # not JSON: something wrote around the logger
            continue
        if entry.get("level") in ("error", "critical"):
            exception = entry.get("exception", "").strip().splitlines()
            last = exception[-1] if exception else ""
            found.append(f"{entry.get('message', '').strip()} {entry.get('path', '')} {last}")
    return found


# -- following a stream ----------------------------------------------------------------


@dataclass
class View:
    """Everything one client received, over all its connections, after ``start``."""

    execution_id: str
    start: int = 0
    frames: list[Frame] = field(default_factory=list)
    connections: int = 0
    no_content: int = 0
    errors: int = 0
    finished: bool = False
    stuck: bool = False

    @property
    def cursor(self) -> int:
        for frame in reversed(self.frames):
            if frame.id is not None:
                return int(frame.id)
        return self.start


async def read_once(
    client: httpx.AsyncClient,
    view: View,
    report: Report,
    *,
    limit: int | None = None,
    request: tuple[str, str, Any] | None = None,
    retry_statuses: Sequence[int] = (),
    on_event: Callable[[Frame], None] | None = None,
) -> bool:
    """One connection: read up to ``limit`` events (all, if None) after the view's cursor,
    then drop it. ``request`` replaces the default GET (a streaming execute). A status in
    ``retry_statuses`` or a transport error leaves the view unfinished, to reconnect
    (returns True); without ``retry_statuses`` a transport error is also a finding."""
    if view.frames and view.frames[-1].id is None:
        view.frames.pop()  # cut right after a gap frame: the same cursor gets it again
    if request is None:
        method, url, body = "GET", f"/api/executions/{view.execution_id}/stream", None
        headers = {**SSE, "Last-Event-ID": str(view.cursor)}
    else:
        method, url, body = request
        headers = dict(SSE)
    view.connections += 1
    report.connections += 1
    answered = False
    try:
        async with client.stream(method, url, headers=headers, json=body) as response:
            answered = True
            if response.status_code == 204:
                view.no_content += 1
                last = view.frames[-1].event if view.frames else None
                if last not in TERMINAL:
                    report.find(f"{view.execution_id}: 204 at cursor {view.cursor} before terminal")
                view.finished = True
                return False
            if response.status_code in retry_statuses:
                view.errors += 1
                return True
            if not view.execution_id:
                view.execution_id = response.headers.get("x-execution-id", "")
            if response.status_code >= 500:
                view.errors += 1
                return True  # already a finding (the response hook); reconnect, as the CLI does
            if response.status_code != 200:
                await response.aread()
                report.find(f"{view.execution_id}: stream answered {response.status_code}")
                view.stuck = True
                return False
            taken = 0
            async for frame in events(response):
                if view.finished:
                    report.find(
                        f"{view.execution_id}: frame {frame.event} id={frame.id} after the "
                        f"terminal event, connection {view.connections} at cursor {view.cursor}"
                    )
                view.frames.append(frame)
                report.frames += 1
                if frame.id is None:
                    continue
                taken += 1
                if on_event is not None:
                    on_event(frame)
                if frame.event in TERMINAL:
                    view.finished = True  # read on: the server must close right after it
                elif limit is not None and taken >= limit:
                    return False
            if not view.finished and limit is None and not retry_statuses:
                report.find(f"{view.execution_id}: stream closed at {view.cursor} before terminal")
            return False
    except httpx.TransportError as exc:
        view.errors += 1
        # Before an answer this is most likely a keep-alive connection the server closed as
        # it was reused (a server crash would show in its log). After one, the server
        # broke the stream: a finding, then a reconnect to see whether anything was lost.
        if answered and not retry_statuses:
            report.find(f"{view.execution_id}: {type(exc).__name__} at cursor {view.cursor}: {exc}")
        return True


async def follow(
    clients: Sequence[httpx.AsyncClient],
    view: View,
    report: Report,
    *,
    deadline: float,
    rng: random.Random | None = None,
    request: tuple[str, str, Any] | None = None,
    retry_statuses: Sequence[int] = (),
    on_event: Callable[[Frame], None] | None = None,
) -> View:
    """Read a stream to its terminal event, reconnecting with the last id on the clients
    in turn (or at random with ``rng``); a stream that does not end by the deadline is
    marked stuck."""
    try:
        async with asyncio.timeout(deadline):
            turn = 0
            while not view.finished and not view.stuck:
                client = rng.choice(clients) if rng else clients[turn % len(clients)]
                failed = await read_once(
                    client,
                    view,
                    report,
                    request=request if turn == 0 else None,
                    retry_statuses=retry_statuses,
                    on_event=on_event,
                )
                turn += 1
                if failed:
                    # EventSource's reconnect delay; the outage ends on its own schedule.
                    await asyncio.sleep(0.1)
    except TimeoutError:
        view.stuck = True
    return view


# -- checking --------------------------------------------------------------------------


async def stored_log(
    client: httpx.AsyncClient, execution_id: str, deadline: float = 30
) -> list[dict[str, Any]]:
    """Every page of ``/events``, retrying 503s (a buffer coming back) until the deadline."""
    found: list[dict[str, Any]] = []
    after = 0
    async with asyncio.timeout(deadline):
        while True:
            response = await client.get(
                f"/api/executions/{execution_id}/events", params={"after": after, "limit": 1000}
            )
            if response.status_code == 503:
                await asyncio.sleep(0.1)
                continue
            response.raise_for_status()
            page = response.json()
            found += page["events"]
            if not page["events"]:
                return found
            after = page["nextAfter"]


async def wait_terminal(
    client: httpx.AsyncClient, execution_id: str, deadline: float
) -> dict[str, Any] | None:
    """Poll the snapshot until its status is terminal; None if the deadline passes."""
    try:
        async with asyncio.timeout(deadline):
            while True:
                response = await client.get(f"/api/executions/{execution_id}")
                if response.status_code == 200:
                    snapshot: dict[str, Any] = response.json()
                    if snapshot["status"] in TERMINAL_STATUSES:
                        return snapshot
                await asyncio.sleep(0.05)
    except TimeoutError:
        return None


def verify(
    report: Report,
    log: list[dict[str, Any]],
    views: Sequence[View],
    *,
    gap_reasons: Sequence[str] = (),
) -> None:
    """The invariants for one execution: a well-formed stored log, and client views that
    are ordered, without duplicates, holes only behind an allowed explicit gap, identical
    to the stored events, and ended by the terminal event."""
    execution_id = log[0]["executionId"] if log else "?"
    try:
        check_log(log, complete=False)
    except AssertionError as exc:
        report.find(f"{execution_id}: corrupted stored log: {exc}")
        return
    if log[-1]["type"] not in TERMINAL:
        report.find(f"{execution_id}: never finished, stored log ends with {log[-1]['type']}")
        return
    by_id = {envelope["id"]: envelope for envelope in log}
    for view in views:
        report.views += 1
        label = f"{view.execution_id} (view from {view.start}, {view.connections} connections)"
        if view.stuck:
            report.find(f"{label}: stuck stream, no terminal event by the deadline")
            continue
        try:
            envelopes = check_view(view.frames, after=view.start)
        except AssertionError as exc:
            report.find(f"{label}: bad view: {exc}")
            continue
        for frame in view.frames:
            if frame.event == "replay:gap" and frame.json["reason"] not in gap_reasons:
                report.find(f"{label}: unexpected gap {frame.json}")
        if not envelopes or envelopes[-1]["type"] not in TERMINAL:
            report.find(f"{label}: did not end with the terminal event")
        for envelope in envelopes:
            if by_id.get(envelope["id"]) != envelope:
                report.find(f"{label}: event {envelope['id']} differs from the stored log")
                break
        gaps = any(frame.event == "replay:gap" for frame in view.frames)
        if not gaps and envelopes != log[view.start :]:
            report.find(f"{label}: {len(envelopes)} events, stored log has {len(log)}")


class Progress:
    """A counter that tasks can wait on, so chaos is timed by events seen, not by sleeps."""

    def __init__(self) -> None:
        self.count = 0
        self._waiters: list[tuple[int, asyncio.Event]] = []

    def add(self, frame: Frame | None = None) -> None:
        self.count += 1
        for target, reached in self._waiters:
            if self.count >= target:
                reached.set()

    async def reach(self, count: int, deadline: float) -> bool:
        """Wait until the counter reaches ``count``; False if the deadline passes first."""
        if self.count >= count:
            return True
        waiter = (count, asyncio.Event())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(deadline):
                await waiter[1].wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters.remove(waiter)


def clock() -> float:
    return time.monotonic()


async def bounded(report: Report, work: Awaitable[None]) -> None:
    """Run the load within the report's time budget; running out is a finding."""
    began = clock()
    try:
        async with asyncio.timeout(report.budget.seconds):
            await work
    except TimeoutError:
        report.find(f"{report.name}: did not finish within {report.budget.seconds:.0f}s")
    except BudgetExceeded as exc:
        report.find(str(exc))
    except ExceptionGroup as group:  # raised inside a task group
        exceeded, rest = group.split(BudgetExceeded)
        if rest is not None:
            raise
        assert exceeded is not None
        report.find(str(exceeded.exceptions[0]))
    finally:
        report.seconds = clock() - began
        report.checking = True
