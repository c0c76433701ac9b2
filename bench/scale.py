"""The ``starts`` and ``streams`` metrics (SPEC section 11): load on whole replicas.

Like ``recovery``, each starts Flowcast processes of its own on the run's Valkey, with
their own Redis prefix, and stops them when it ends. The load comes from
``bench/scale_client.py`` processes; every figure is given with the server's CPU (its
process tree's ``utime + stime`` from ``/proc/<pid>/stat``) beside each client
process's (``getrusage``), so a reader can tell whether the server or the client was
the limit.

- ``starts``: executions of one ``transform`` block started and completed per second,
  each by one ``POST …/execute`` with ``Accept: text/event-stream`` read to its
  terminal event; 64 loops on one replica, 256 on one, 64 over two.
- ``streams``: one replica running 1,000 executions that emit 1 event/s each; 5,000 SSE
  clients opened at once (time until all are open, failures, server CPU per open),
  delivery latency with them attached, then with 10,000; server RSS per client and the
  Redis connections the replica holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis.asyncio import Redis

from bench.report import Report, Row, ms, percentile, ratio, verdict
from bench.rss import status_bytes
from bench.stack import Config, Stack, words, workflows
from tests.support.servers import ROOT, FlowcastServer

KiB = 1024
MiB = 1024 * KiB
TICK = os.sysconf("SC_CLK_TCK")
BACKLOG = 8192
OPEN_TIMEOUT = 60.0  # for the clients opened at once
GROW_BATCH = 1_000  # the growth to the total is opened this many at a time...
GROW_BUDGET = 120.0  # ...within this many seconds


# --- /proc ---------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (the template workers of a server)."""
    found = [pid]
    for parent in found:  # grows while it is walked
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    found += [int(child) for child in (task / "children").read_text().split()]
    return found


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of one process, from ``/proc/<pid>/stat``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields 3 onwards
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its children (processes may come and go)."""
    total = 0.0
    for each in descendants(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += process_cpu(each)
    return total


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from the first line of ``/proc/stat``."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return sum(values) - idle, sum(values)


def open_files_limit(pid: int) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return line.split()[3]
    return "?"


def redis_ports(pid: int, redis_port: int) -> set[int]:
    """The local ports of the process tree's established TCP connections to ``redis_port``.

    Exact: the sockets a process holds are the ``socket:[inode]`` links in
    ``/proc/<pid>/fd``; ``/proc/<pid>/net/tcp`` gives each inode's addresses and state.
    """
    inodes: set[str] = set()
    for each in descendants(pid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{each}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{each}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] != "01" or parts[9] not in inodes:  # 01: ESTABLISHED
                    continue
                if int(parts[2].rsplit(":", 1)[1], 16) == redis_port:
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


@dataclass
class Usage:
    """CPU use over one window: the server's tree, Valkey, the machine."""

    pids: list[int]
    valkey: int | None
    wall: float = 0.0
    server: float = 0.0  # CPU seconds
    store: float = 0.0
    busy: float = 0.0  # share of all CPUs
    _start: tuple[float, float, float, tuple[int, int]] = (0.0, 0.0, 0.0, (0, 0))

    def begin(self) -> None:
        self._start = (time.perf_counter(), self._server(), self._store(), machine_jiffies())

    def end(self) -> None:
        wall, server, store, (busy, total) = self._start
        self.wall = time.perf_counter() - wall
        self.server = self._server() - server
        self.store = self._store() - store
        now_busy, now_total = machine_jiffies()
        self.busy = (now_busy - busy) / max(now_total - total, 1)

    def _server(self) -> float:
        return sum(tree_cpu(pid) for pid in self.pids)

    def _store(self) -> float:
        if self.valkey is None:
            return 0.0
        with contextlib.suppress(OSError):
            return process_cpu(self.valkey)
        return 0.0

    def describe(self) -> str:
        cpus = os.cpu_count() or 1
        return (
            f"server CPU {self.server / self.wall:.0%} of a core, Valkey "
            f"{self.store / self.wall:.0%}, machine busy {self.busy:.0%} of {cpus} CPUs"
        )


# --- processes ---------------------------------------------------------------------


class ScaleServer(FlowcastServer):
    """A Flowcast process with a large listen backlog (the kernel caps it at somaxconn)."""

    def command(self) -> list[str]:
        return [*super().command(), "--backlog", str(BACKLOG)]


def raise_nofile() -> int:
    """Raise this process's open-file limit to the hard limit; servers started after
    inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


async def stop_server(server: FlowcastServer, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it overstays ``timeout``."""
    pid = server._process.pid if server._process is not None else None
    try:
        await server.stop(signal.SIGTERM, timeout=timeout)
    except subprocess.TimeoutExpired:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Worker:
    """One ``bench/scale_client.py`` process (or another ``module`` that speaks the same
    way, as ``stress/mass_client.py``): JSON commands in, JSON answers out."""

    def __init__(self, log_path: Path, module: str = "bench.scale_client") -> None:
        self.log_path = log_path
        self.module = module
        self.process: asyncio.subprocess.Process | None = None
        self.cpu = 0.0  # the CPU seconds of its last ``stats``

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module,
                cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log, limit=1 << 26,
            )  # fmt: skip
        await self.answer(timeout=30)

    async def ask(self, command: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(orjson.dumps(command) + b"\n")
        await self.process.stdin.drain()
        return await self.answer(timeout=timeout)

    async def answer(self, *, timeout: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        async with asyncio.timeout(timeout):
            line = await self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text()[-500:] if self.log_path.exists() else ""
            raise RuntimeError(f"the client process ended: {tail}")
        answer: dict[str, Any] = orjson.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None and process.stdin is not None:
            with contextlib.suppress(Exception):
                self.process = process
                await self.ask({"cmd": "exit"}, timeout=20)
            self.process = None
        try:
            async with asyncio.timeout(10):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def workers(count: int, root: Path, name: str, module: str = "bench.scale_client") -> Any:
    started = [Worker(root / f"{name}-client-{index}.log", module) for index in range(count)]
    try:
        await asyncio.gather(*(worker.start() for worker in started))
        yield started
    finally:
        await asyncio.gather(*(worker.stop() for worker in started), return_exceptions=True)


def split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous slices of nearly equal length."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def shares(cpus: list[float], wall: float) -> str:
    """Each client process's CPU share of one core."""
    return ", ".join(f"{cpu / wall:.0%}" for cpu in cpus)


# --- starts --------------------------------------------------------------------------


@dataclass
class StartsCase:
    clients: int
    replicas: int
    seconds: float
    completed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    errors_in_window: int = 0
    connections: int = 0
    client_cpu: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    usage: Usage | None = None

    @property
    def rate(self) -> float:
        return self.completed / self.seconds

    @property
    def label(self) -> str:
        return f"{self.clients} clients, {self.replicas} replica{'s' * (self.replicas > 1)}"

    def cell(self) -> str:
        assert self.usage is not None
        text = (
            f"{self.rate:,.0f}/s; CPU: server {self.usage.server / self.seconds:.0%}, "
            f"client {max(self.client_cpu) / self.seconds:.0%} of a core"
        )
        if self.errors_in_window:
            text += f"; {self.errors_in_window} errors"
        return text

    @property
    def per_start(self) -> float:
        """Server CPU seconds per completed execution."""
        assert self.usage is not None
        return self.usage.server / max(self.completed, 1)

    def note(self) -> str:
        assert self.usage is not None
        per_start = self.per_start
        errors = (
            ", ".join(f"{count} {reason}" for reason, count in self.errors.items())
            if self.errors
            else "none"
        )
        return (
            f"starts, {self.label}: {self.completed:,} executions completed in "
            f"{self.seconds:g} s; {self.usage.describe()}; server CPU "
            f"{ms(per_start)} per start; client process(es) {shares(self.client_cpu, self.seconds)}"
            f" of a core; request → terminal event p50 {ms(percentile(self.durations, 50))}, "
            f"p99 {ms(percentile(self.durations, 99))}; errors (whole run, warm-up "
            f"included): {errors}; {self.connections} connections opened."
        )


class Scale:
    """The ``starts`` and ``streams`` metrics; each adds its rows to the report."""

    def __init__(self, stack: Stack, config: Config, report: Report) -> None:
        self.stack = stack
        self.config = config
        self.report = report
        self.http = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64))
        raw = getattr(stack.valkey, "_process", None)
        self.valkey_pid: int | None = raw.pid if raw is not None else None

    async def close(self) -> None:
        await self.http.aclose()

    async def register(self, server: FlowcastServer, workflow_id: str) -> None:
        workflow = next(w for w in workflows(self.config) if w["id"] == workflow_id)
        response = await self.http.put(f"{server.url}/api/workflows/{workflow_id}", json=workflow)
        response.raise_for_status()

    # --- starts ------------------------------------------------------------------------

    async def starts(self) -> None:
        config = self.config
        raise_nofile()
        env = self.stack.flowcast_env(
            FLOWCAST_REDIS_PREFIX="fcstarts",
            FLOWCAST_SECRET_KEY=secrets.token_urlsafe(32),  # replicas must share it
            FLOWCAST_MAX_STREAMS_PER_TENANT="0",
        )
        a = ScaleServer(data_dir=self.stack.root / "starts-a", env=env)
        b = ScaleServer(data_dir=self.stack.root / "starts-b", env=env)
        base, more = config.starts_clients
        try:
            await asyncio.gather(a.start(), b.start())
            await self.register(a, "bench-starts")
            one = await self.starts_case(base, [a])
            wide = await self.starts_case(more, [a])
            two = await self.starts_case(base, [a, b])
        finally:
            await asyncio.gather(stop_server(a), stop_server(b), return_exceptions=True)
        self.report.notes.append(
            f"starts: `POST /api/workflows/bench-starts/execute` (one `transform` block) with "
            "`Accept: text/event-stream`, each response read to its terminal event; every "
            "client loop keeps one keep-alive connection and sends its next request once the "
            "previous stream ended (so TCP connect/accept is not in the figure). A case is "
            f"{config.starts_warmup:g} s of warm-up, then {config.starts_seconds:g} s counted "
            "(executions whose `execution:completed` arrived in the window); errors are "
            "non-200 answers and streams that end without `execution:completed`. The clients "
            f"run in {config.starts_workers} `bench/scale_client.py` process(es); with two "
            "replicas the loops alternate between them. Server CPU is the uvicorn process "
            "tree's utime+stime (/proc), summed over the replicas."
        )
        for case in (one, wide, two):
            self.report.notes.append(case.note())
        target = 1200
        self.report.add(
            Row(
                f"starts/s, {one.label}",
                one.cell(),
                "—",
                "—",
                f"≥ {target:,}/s",
                verdict(one.rate >= target and not one.errors_in_window),
            )
        )
        self.report.add(
            Row(
                f"starts/s, {wide.label}",
                wide.cell(),
                f"{base} clients: {one.rate:,.0f}/s",
                ratio(wide.rate, one.rate),
                f"≥ 0.9x {base} clients",
                verdict(wide.rate >= 0.9 * one.rate and not wide.errors_in_window),
            )
        )
        self.report.add(
            Row(
                f"starts/s, {two.label}",
                two.cell(),
                f"1 replica: {one.rate:,.0f}/s",
                ratio(two.rate, one.rate),
                "≥ 1.8x 1 replica",
                verdict(two.rate >= 1.8 * one.rate and not two.errors_in_window),
            )
        )
        per = [
            case.usage.server / max(case.completed, 1) for case in (one, wide, two) if case.usage
        ]
        self.report.add(
            Row(
                "server CPU per start (info)",
                f"{ms(per[0])} / {ms(per[1])} / {ms(per[2])}",
                "—",
                "—",
                f"{one.label} / {wide.clients} / {two.replicas} replicas",
            )
        )

    async def starts_case(self, clients: int, servers: list[ScaleServer]) -> StartsCase:
        config = self.config
        case = StartsCase(clients=clients, replicas=len(servers), seconds=config.starts_seconds)
        usage = Usage([server.pid for server in servers], self.valkey_pid)
        ports = [server.port for server in servers]
        async with workers(config.starts_workers, self.stack.root, "starts") as procs:
            t0 = time.time() + config.starts_warmup
            t1 = t0 + config.starts_seconds

            async def window() -> None:
                await asyncio.sleep(max(t0 - time.time(), 0))
                usage.begin()
                await asyncio.sleep(max(t1 - time.time(), 0))
                usage.end()

            loops = split(list(range(clients)), len(procs))
            answers, _ = await asyncio.gather(
                asyncio.gather(
                    *(
                        proc.ask(
                            {
                                "cmd": "starts",
                                "path": "/api/workflows/bench-starts/execute",
                                "ports": ports,
                                "loops": len(share),
                                "t0": t0,
                                "t1": t1,
                                "timeout": 30,
                            },
                            timeout=t1 - time.time() + 60,
                        )
                        for proc, share in zip(procs, loops, strict=True)
                    )
                ),
                window(),
            )
        for answer in answers:
            case.completed += answer["completed"]
            case.errors.update(answer["errors"])
            case.errors_in_window += answer["errors_in_window"]
            case.connections += answer["connections"]
            case.client_cpu.append(answer["cpu"])
            case.durations += answer["durations"]
        case.durations = case.durations or [0.0]
        case.usage = usage
        print(f"  starts, {case.label}: {case.rate:,.0f}/s ({usage.describe()})", flush=True)
        return case

    # --- streams -----------------------------------------------------------------------

    async def streams(self) -> None:
        config = self.config
        raise_nofile()
        server = ScaleServer(
            data_dir=self.stack.root / "streams",
            env=self.stack.flowcast_env(
                FLOWCAST_REDIS_PREFIX="fcstreams",
                FLOWCAST_MAX_STREAMS_PER_TENANT="0",
                FLOWCAST_SHUTDOWN_GRACE_SECONDS="2",
            ),
        )
        try:
            await server.start()
            async with workers(config.streams_workers, self.stack.root, "streams") as procs:
                await Streams(self, server, procs).run()
        finally:
            await stop_server(server)

    async def cursors(self, server: FlowcastServer, ids: list[str]) -> dict[str, int]:
        """Each execution's last event id now."""
        gate = asyncio.Semaphore(32)

        async def one(execution_id: str) -> tuple[str, int]:
            async with gate:
                response = await self.http.get(f"{server.url}/api/executions/{execution_id}")
                response.raise_for_status()
                return execution_id, int(response.json()["lastEventId"])

        return dict(await asyncio.gather(*(one(i) for i in ids)))


@dataclass
class Opened:
    attempted: int
    clients: int  # opened
    seconds: float  # command sent → the last client's headers
    failed: Counter[str]
    cpu: float = 0.0  # server CPU seconds meanwhile...
    idle_cpu: float = 0.0  # ...of which this much at the rate it had with no client
    client_cpu: list[float] = field(default_factory=list)  # each client process's share

    @property
    def per_open(self) -> float:
        """Server CPU seconds per open, the idle rate taken off."""
        return (self.cpu - self.idle_cpu) / max(self.clients, 1)

    @property
    def gross(self) -> float:
        """The same, without taking the idle rate off."""
        return self.cpu / max(self.clients, 1)


@dataclass
class Delivery:
    clients: int
    latencies: list[float]
    usage: Usage
    client_cpu: list[float]
    rss: int
    redis: set[int]
    ended: Counter[str]


class Streams:
    """One run of the streams metric on its own replica and client processes."""

    def __init__(self, scale: Scale, server: ScaleServer, procs: list[Worker]) -> None:
        self.scale = scale
        self.config = scale.config
        self.report = scale.report
        self.server = server
        self.procs = procs
        self.redis_port = scale.stack.valkey.port
        self.targets: list[list[Any]] = []
        self.next_target = 0
        self.idle_rate = 0.0

    async def run(self) -> None:
        config, server, scale = self.config, self.server, self.scale
        pid = server.pid
        redis_idle = redis_ports(pid, self.redis_port)
        await scale.register(server, "bench-streams")
        # Long enough for every phase: the run stops the server when it is done.
        text = words(600)
        gate = asyncio.Semaphore(32)

        async def start() -> str:
            async with gate:
                response = await scale.http.post(
                    f"{server.url}/api/workflows/bench-streams/execute",
                    json={"input": {"text": text}},
                )
                response.raise_for_status()
                execution_id: str = response.json()["executionId"]
                return execution_id

        began = time.perf_counter()
        ids = await asyncio.gather(*(start() for _ in range(config.streams_executions)))
        start_seconds = time.perf_counter() - began
        await asyncio.sleep(2)  # every execution emitting
        redis_running = redis_ports(pid, self.redis_port)
        idle = Usage(descendants(pid), scale.valkey_pid)
        idle.begin()
        await asyncio.sleep(3)
        idle.end()
        self.idle_rate = idle.server / idle.wall
        rss_before = status_bytes(pid, "VmRSS")
        positions = await scale.cursors(server, ids)
        self.targets = [
            [f"/api/executions/{ids[i % len(ids)]}/stream", positions[ids[i % len(ids)]]]
            for i in range(config.streams_total)
        ]
        first = await self.open(config.streams_open)
        await asyncio.sleep(config.streams_settle)
        at_open = await self.deliver(first.clients)
        grown = await self.grow(config.streams_total - config.streams_open)
        await asyncio.sleep(config.streams_settle)
        at_total = await self.deliver(first.clients + grown.clients)
        listed = await self.client_list(at_total.redis)
        self.add_rows(
            listed=listed,
            start_seconds=start_seconds,
            idle=idle,
            rss_before=rss_before,
            redis_idle=redis_idle,
            redis_running=redis_running,
            first=first,
            grown=grown,
            at_open=at_open,
            at_total=at_total,
        )

    async def open(self, count: int, *, timeout: float = OPEN_TIMEOUT) -> Opened:
        """Open ``count`` more streams, all at once, spread over the client processes;
        a stream whose headers are not in ``timeout`` after the command fails."""
        targets = self.targets[self.next_target : self.next_target + count]
        self.next_target += count
        pids = descendants(self.server.pid)
        cpu = sum(tree_cpu(p) for p in pids)
        sent = time.time()
        began = time.perf_counter()
        answers = await asyncio.gather(
            *(
                proc.ask(
                    {"cmd": "open", "port": self.server.port, "targets": share, "timeout": timeout},
                    timeout=timeout + 30,
                )
                for proc, share in zip(self.procs, split(targets, len(self.procs)), strict=True)
            )
        )
        wall = time.perf_counter() - began
        used = sum(tree_cpu(p) for p in pids) - cpu
        failed: Counter[str] = Counter()
        for answer in answers:
            failed.update(answer["failed"])
        heads = [answer["last_head"] for answer in answers if answer["last_head"] is not None]
        return Opened(
            attempted=len(targets),
            clients=sum(answer["opened"] for answer in answers),
            seconds=max(heads, default=sent) - sent,
            failed=failed,
            cpu=used,
            idle_cpu=self.idle_rate * wall,
            client_cpu=[answer["cpu"] / max(wall, 1e-6) for answer in answers],
        )

    async def grow(self, count: int) -> Opened:
        """Open ``count`` more streams in batches of ``GROW_BATCH`` within ``GROW_BUDGET``
        seconds; the batches the budget leaves no time for are not attempted."""
        deadline = time.perf_counter() + GROW_BUDGET
        sent = time.perf_counter()
        total = Opened(attempted=0, clients=0, seconds=0.0, failed=Counter())
        while total.attempted < count:
            left = deadline - time.perf_counter()
            if left <= 1:
                total.failed["not attempted (budget spent)"] += count - total.attempted
                break
            batch = await self.open(min(GROW_BATCH, count - total.attempted), timeout=left)
            total.attempted += batch.attempted
            total.clients += batch.clients
            total.failed.update(batch.failed)
            total.cpu += batch.cpu
            total.idle_cpu += batch.idle_cpu
            total.client_cpu = [
                max(a, b) for a, b in zip_longest(total.client_cpu, batch.client_cpu, fillvalue=0)
            ]
        total.seconds = time.perf_counter() - sent
        return total

    async def deliver(self, clients: int) -> Delivery:
        """Delivery latencies over the window, with what the server and clients used."""
        window = self.config.streams_window
        usage = Usage(descendants(self.server.pid), self.scale.valkey_pid)
        before = await self.stats()
        await asyncio.gather(
            *(p.ask({"cmd": "record", "on": True}, timeout=30) for p in self.procs)
        )
        usage.begin()
        await asyncio.sleep(window)
        usage.end()
        answers = await asyncio.gather(
            *(p.ask({"cmd": "record", "on": False}, timeout=60) for p in self.procs)
        )
        after = await self.stats()
        ended: Counter[str] = Counter()
        for stats in after:
            ended.update(stats["ended"])
        return Delivery(
            clients=clients,
            latencies=[value for answer in answers for value in answer["latencies"]] or [0.0],
            usage=usage,
            client_cpu=[
                (b["cpu"] - a["cpu"]) / usage.wall for a, b in zip(before, after, strict=True)
            ],
            rss=status_bytes(self.server.pid, "VmRSS"),
            redis=redis_ports(self.server.pid, self.redis_port),
            ended=ended,
        )

    async def stats(self) -> list[dict[str, Any]]:
        return list(
            await asyncio.gather(*(p.ask({"cmd": "stats"}, timeout=30) for p in self.procs))
        )

    async def client_list(self, ports: set[int]) -> int:
        """How many of CLIENT LIST's entries come from ``ports`` (a cross-check)."""
        async with Redis.from_url(self.scale.stack.valkey.url) as redis:
            entries = await redis.client_list()
        return sum(1 for entry in entries if int(entry["addr"].rsplit(":", 1)[1]) in ports)

    def add_rows(
        self,
        *,
        listed: int,
        start_seconds: float,
        idle: Usage,
        rss_before: int,
        redis_idle: set[int],
        redis_running: set[int],
        first: Opened,
        grown: Opened,
        at_open: Delivery,
        at_total: Delivery,
    ) -> None:
        config, report = self.config, self.report
        executions = config.streams_executions
        limit = open_files_limit(self.server.pid)
        report.notes.append(
            f"streams: one replica of its own (Redis prefix fcstreams, "
            f"FLOWCAST_MAX_STREAMS_PER_TENANT=0, uvicorn --backlog {BACKLOG}, which the "
            f"kernel caps at net.core.somaxconn = {somaxconn()}; open files limit {limit}) "
            f"runs {executions:,} `generate` executions at tokensPerSecond 1 (started in "
            f"{start_seconds:.1f} s); with no client attached it used {idle.describe()}. "
            f"Clients run in {len(self.procs)} `bench/scale_client.py` processes (raw asyncio "
            "protocol, one connection per stream), client i on execution i mod "
            f"{executions:,}, `GET /api/executions/{{id}}/stream` with `Last-Event-ID` = the "
            "execution's lastEventId read just before (a few events may replay; latencies "
            f"are only recorded after the opens and {config.streams_settle:g} s of settling)."
        )
        report.notes.append(
            f"streams, opening {first.attempted:,} at once: {first.clients:,} open (response "
            f"headers in), the last {first.seconds:.2f} s after the command; failures "
            f"{describe(first.failed)} (a client gives up {OPEN_TIMEOUT:g} s after the "
            f"command); server CPU {ms(first.per_open)} per open with the idle rate "
            f"({idle.server / idle.wall:.0%} of a core) taken off, {ms(first.gross)} gross "
            "(both include sending the events of the executions to the clients already "
            f"open); client processes {shares(first.client_cpu, 1)} of a core while opening. "
            f"Growing by {grown.attempted:,} in batches of {GROW_BATCH:,} (each at once, all "
            f"within {GROW_BUDGET:g} s): {grown.clients:,} opened in {grown.seconds:.2f} s, "
            f"failures {describe(grown.failed)}, {ms(grown.per_open)} per open "
            f"({ms(grown.gross)} gross), client processes at most "
            f"{shares(grown.client_cpu, 1)} of a core."
        )
        for delivery in (at_open, at_total):
            expected = delivery.clients * config.streams_window
            report.notes.append(
                f"streams, {delivery.clients:,} clients attached: "
                f"{len(delivery.latencies):,} chunk deliveries in {delivery.usage.wall:.1f} s "
                f"(≈ {expected:,.0f} expected at 1 event/s each), p50 "
                f"{ms(percentile(delivery.latencies, 50))}, p99 "
                f"{ms(percentile(delivery.latencies, 99))}, max {ms(max(delivery.latencies))}; "
                f"{delivery.usage.describe()}; client processes "
                f"{shares(delivery.client_cpu, 1)} of a core; server RSS "
                f"{delivery.rss / MiB:.0f} MiB (before any client {rss_before / MiB:.0f} MiB); "
                f"streams ended by the server or reset so far: {describe(delivery.ended)}."
            )
        redis_max = max(len(at_open.redis), len(at_total.redis), len(redis_running))
        report.notes.append(
            "streams, Redis connections: the server process tree's established TCP "
            "connections to the Valkey port (socket inodes in /proc/<pid>/fd matched in "
            f"/proc/<pid>/net/tcp): {len(redis_idle)} before any execution, "
            f"{len(redis_running)} with {executions:,} running, {len(at_open.redis)} with "
            f"{at_open.clients:,} clients, {len(at_total.redis)} with {at_total.clients:,} "
            f"(CLIENT LIST on the Valkey shows {listed} entries from those ports)."
        )
        reset = sum(first.failed.values()) + sum(at_open.ended.values())
        opened = (
            f"{first.seconds:.2f} s"
            if first.clients == first.attempted
            else f"only {first.clients:,} open after {first.seconds:.2f} s"
        )
        report.add(
            Row(
                f"streams: {config.streams_open:,} clients opening at once → all open",
                f"{opened}, {reset} failed or reset",
                "—",
                "—",
                "≤ 5 s, none reset",
                verdict(first.seconds <= 5 and not reset and first.clients == config.streams_open),
            )
        )
        report.add(
            Row(
                "streams: server CPU per open",
                f"{ms(first.per_open)}; client CPU {max(first.client_cpu):.0%} of a core",
                "—",
                "—",
                "≤ 1 ms",
                verdict(first.per_open <= 0.001),
            )
        )
        for delivery, wanted, target in (
            (at_open, config.streams_open, 0.100),
            (at_total, config.streams_total, 0.250),
        ):
            p50 = percentile(delivery.latencies, 50)
            p99 = percentile(delivery.latencies, 99)
            usage = delivery.usage
            short = "" if delivery.clients == wanted else f"; only {delivery.clients:,} open"
            report.add(
                Row(
                    f"streams: delivery p99 (p50), {wanted:,} clients on "
                    f"{executions:,} executions at 1 ev/s",
                    f"{ms(p99)} ({ms(p50)}); CPU: server {usage.server / usage.wall:.0%}, "
                    f"client {max(delivery.client_cpu):.0%} of a core{short}",
                    "—",
                    "—",
                    f"p99 ≤ {target * 1000:.0f} ms",
                    verdict(p99 <= target and not delivery.ended and not short),
                )
            )
        per_client = (at_total.rss - rss_before) / max(at_total.clients, 1)
        per_client_open = (at_open.rss - rss_before) / max(at_open.clients, 1)
        report.add(
            Row(
                f"streams: server RSS per client, {at_total.clients:,} clients",
                f"{per_client / KiB:.1f} KiB",
                f"{at_open.clients:,} clients: {per_client_open / KiB:.1f} KiB",
                "—",
                "≤ 32 KiB",
                verdict(per_client <= 32 * KiB),
            )
        )
        report.add(
            Row(
                "streams: Redis connections the replica holds",
                f"{redis_max} (with {executions:,} executions and up to "
                f"{at_total.clients:,} clients)",
                f"idle: {len(redis_idle)}",
                "—",
                "≤ 32",
                verdict(redis_max <= 32),
            )
        )


def describe(counts: Counter[str]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{count} {reason}" for reason, count in counts.most_common())


def somaxconn() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/net/core/somaxconn").read_text().strip()
    return "?"
