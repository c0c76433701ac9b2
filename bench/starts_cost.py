"""The ``starts-cost`` metric: SPEC section 11's ``starts`` row as ratios to a bare
endpoint measured in the same run (step 17).

Processes of its own on the run's Valkey (Redis prefix ``fcstartcost``): an API replica
that runs no work (``FLOWCAST_WORKER_SLOTS=0``), one ``flowcast worker`` (64 slots),
and the bare FastAPI endpoint of ``bench/baseline_api.py`` in its own uvicorn process,
started with the same uvicorn options as the replica. The load comes from one
``bench/scale_client.py`` process (``posts``): N loops, each on its own keep-alive
connection, each sending ``POST /api/workflows/bench-starts/execute`` with the same JSON
body as soon as the previous answer (202) is in. Flowcast and the bare endpoint take
turns, so a noisy neighbour hits both.

- cost: ``count`` executions of one ``transform`` block posted to the API replica with
  the worker running them; the API replica's and the worker's process trees' CPU
  (``/proc`` utime + stime) from the first request until every one is ``completed``
  in its stored index (and none is left in the ``open`` one), ÷ the executions. Beside
  it, the bare endpoint's process tree's CPU for the same ``count`` requests ÷ count.
  Redis commands (``INFO commandstats``) and round trips (``total_reads_processed``)
  per execution are read around the same executions.
- accept: the worker stopped, the API replica alone answers ``202 queued``; the 202s
  that arrive in a window after a warm-up, per second, beside the bare endpoint's under
  the same load. Nothing takes the queued executions, so the tenant's limit on
  unfinished executions is lifted (``FLOWCAST_MAX_EXECUTIONS_PER_TENANT=0``).
- where a start's Redis work goes: a short sample of starts with ``MONITOR`` on, each
  command counted by the process that sent it (its connection's port, matched to the
  process by ``/proc``) and each script call by the script's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import secrets
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis.asyncio import Redis

from bench.report import Report, Row, ms, percentile, ratio, verdict
from bench.scale import (
    ScaleServer,
    Usage,
    Worker,
    descendants,
    process_cpu,
    raise_nofile,
    redis_ports,
    stop_server,
    tree_cpu,
    workers,
)
from bench.stack import BUCKET, Config, Stack
from lib.backend import Keys, script_source
from tests.support.s3 import CREDENTIALS
from tests.support.servers import ROOT, FlowcastServer, FlowcastWorker

PREFIX = "fcstartcost"
WORKFLOW = "bench-starts"
PATH = f"/api/workflows/{WORKFLOW}/execute"
BODY = {"input": {"amount": 40, "customer": "Zed"}}
TENANT = "default"  # no API keys: every request is the default tenant's
POLL = 0.05  # how often completion is looked for
DONE_TIMEOUT = 300.0  # every posted execution completed within this
# The bare endpoint's CPU is taken over this many times more requests: it answers one in
# about a tenth of a millisecond, and /proc counts CPU in ticks of 10 ms.
BARE_TIMES = 10
# A request in moto's (werkzeug's) access log.
ACCESS = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) /')


def transform() -> dict[str, Any]:
    return {"id": WORKFLOW, "blocks": [{"id": "only", "type": "transform", "config": {}}]}


class BareServer(ScaleServer):
    """The bare FastAPI endpoint (``bench/baseline_api.py``), with the uvicorn options of
    the Flowcast replica it is compared with."""

    def command(self) -> list[str]:
        return [
            "bench.baseline_api:create_app" if part == "app.main:create_app" else part
            for part in super().command()
        ]


@dataclass
class Cost:
    """``count`` requests answered, and what they cost: CPU seconds per process kind."""

    count: int = 0
    wall: float = 0.0
    server: float = 0.0  # API replica (or the bare endpoint) + worker
    api: float = 0.0
    worker: float = 0.0
    valkey: float = 0.0
    client: float = 0.0
    busy: float = 0.0  # the machine's busy share
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    commands: Counter[str] = field(default_factory=Counter)  # Redis commands, by name
    reads: int = 0  # Valkey's read events (a round trip each)
    answered: int = 0  # answers in all, a warm-up's included (what commands and reads cover)
    main: float = 0.0  # of ``server``: the main processes' own (not their helpers')
    logged: int = 0  # log lines the servers wrote
    s3: Counter[str] = field(default_factory=Counter)  # value store requests, by method
    s3_cpu: float = 0.0  # the value store's (moto's) CPU
    durations: list[float] = field(default_factory=list)

    def add(self, other: Cost) -> None:
        for name in (
            *("count", "wall", "server", "api", "worker", "valkey", "client", "reads"),
            *("answered", "main", "logged"),
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.busy = max(self.busy, other.busy)
        self.statuses.update(other.statuses)
        self.s3.update(other.s3)
        self.s3_cpu += other.s3_cpu
        self.errors.update(other.errors)
        self.commands.update(other.commands)
        self.durations += other.durations

    def per(self, seconds: float) -> float:
        return seconds / max(self.count, 1)

    @property
    def rate(self) -> float:
        return self.count / self.wall if self.wall else 0.0


class StartsCost:
    """Runs the three parts; each adds its rows and notes to the report."""

    def __init__(
        self, stack: Stack, config: Config, report: Report, *, prefix: str = PREFIX
    ) -> None:
        self.stack = stack
        self.config = config
        self.report = report
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.clients = config.starts_clients[0]
        raw = getattr(stack.valkey, "_process", None)
        self.valkey_pid: int | None = raw.pid if raw is not None else None
        env = stack.flowcast_env(
            FLOWCAST_REDIS_PREFIX=prefix,
            FLOWCAST_SECRET_KEY=secrets.token_urlsafe(32),  # the processes must share it
            FLOWCAST_MAX_EXECUTIONS_PER_TENANT="0",  # the accept part queues thousands
            FLOWCAST_TENANT_STORAGE_BYTES="0",  # counted, never refused
        )
        root = stack.root
        self.api = ScaleServer(
            data_dir=root / "startcost-api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"}
        )
        self.worker = FlowcastWorker(data_dir=root / "startcost-worker", env=env)
        self.bare = BareServer(data_dir=root / "startcost-bare")
        self.idle = 0.0  # CPU share of API replica + worker with nothing to do
        self.moto = getattr(stack, "moto", None)  # the S3 value store (the smoke test has none)

    async def run(self) -> None:
        raise_nofile()
        try:
            await asyncio.gather(self.api.start(), self.worker.start(), self.bare.start())
            async with httpx.AsyncClient(timeout=30) as http:
                response = await http.put(
                    f"{self.api.url}/api/workflows/{WORKFLOW}", json=transform()
                )
                response.raise_for_status()
            async with (
                Redis.from_url(self.stack.valkey.url) as redis,
                workers(1, self.stack.root, "startcost") as procs,
            ):
                client = procs[0]
                await self.measure(redis, client)
        finally:
            await asyncio.gather(
                stop_server(self.bare),
                stop_server(self.worker),
                # Thousands left queued: nothing to hand off.
                self.api.stop(signal.SIGKILL, timeout=10),
                return_exceptions=True,
            )

    async def measure(self, redis: Redis, client: Worker) -> None:
        config = self.config
        count = config.starts_cost_count
        warm = min(count, 1_000)
        await self.bare_cost(client, warm * BARE_TIMES)
        await self.flowcast_cost(redis, client, warm)
        self.idle = await self.idle_share()
        bare, flowcast = Cost(), Cost()
        for _ in range(config.starts_cost_rounds):
            bare.add(await self.bare_cost(client, count * BARE_TIMES))
            flowcast.add(await self.flowcast_cost(redis, client, count))
        sample = await self.monitor(redis, client, config.starts_cost_sample)
        await stop_server(self.worker)
        bare_rate, accept = Cost(), Cost()
        for _ in range(config.starts_cost_rounds):
            bare_rate.add(await self.rate(client, self.bare, [self.bare]))
            accept.add(await self.rate(client, self.api, [self.api], redis=redis))
        calls = await client_costs(redis)
        calls.s3_put = await self.put_cost()
        self.add_rows(bare, flowcast, bare_rate, accept, sample, calls)

    # --- cost: accepted → completed stored ---------------------------------------------

    async def bare_cost(self, client: Worker, count: int) -> Cost:
        usage = Usage(descendants(self.bare.pid), self.valkey_pid)
        usage.begin()
        answer = await self.post(client, self.bare, count=count)
        usage.end()
        return self.cost(answer, usage, api=usage.server)

    async def flowcast_cost(self, redis: Redis, client: Worker, count: int) -> Cost:
        api = Usage(descendants(self.api.pid), self.valkey_pid)
        worker = Usage(descendants(self.worker.pid), None)
        completed, opened = self.completed_key(), self.open_key()
        before = int(await redis.zcard(completed))
        stats = await commandstats(redis)
        logged = self.log_lines()
        s3 = self.s3()
        mains = process_cpu(self.api.pid) + process_cpu(self.worker.pid)
        api.begin()
        worker.begin()
        answer = await self.post(client, self.api, count=count)
        accepted = int(answer["statuses"].get("202", 0))
        polls = await self.until_done(redis, before + accepted, completed, opened)
        api.end()
        worker.end()
        mains = process_cpu(self.api.pid) + process_cpu(self.worker.pid) - mains
        after = await commandstats(redis)
        cost = self.cost(answer, api, api=api.server, worker=worker.server)
        cost.main = mains
        cost.logged = self.log_lines() - logged
        cost.answered = cost.count
        after_s3 = self.s3()
        cost.s3, cost.s3_cpu = after_s3[0] - s3[0], after_s3[1] - s3[1]
        cost.wall = api.wall  # to the last completion
        cost.busy = api.busy
        cost.commands = Counter(
            {name: n for name, n in (after.commands - stats.commands).items() if name != "info"}
        )
        # The polls' own: one round trip of two ZCARDs each.
        cost.commands["zcard"] -= 2 * polls
        cost.commands = +cost.commands
        cost.reads = after.reads - stats.reads - polls - 1  # the second INFO's own read
        return cost

    def s3(self) -> tuple[Counter[str], float]:
        """The value store's requests so far by method (its access log) and its CPU."""
        if self.moto is None:
            return Counter(), 0.0
        log = self.moto.log_path.read_text(errors="replace")
        requests = Counter(match.group(1) for match in ACCESS.finditer(log))
        return requests, tree_cpu(self.moto.pid)

    async def put_cost(self, count: int = 200) -> float | None:
        """CPU seconds of one small PUT to the value store in this process, made as
        lib/execution/s3.py makes it (boto3 in a worker thread); None without S3."""
        if self.moto is None:
            return None
        import boto3
        from botocore.config import Config as BotoConfig

        client = boto3.client(
            "s3",
            endpoint_url=self.moto.url,
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            config=BotoConfig(retries={"max_attempts": 3, "mode": "standard"}),
        )
        body = b"x" * 200
        for index in range(count + 20):  # the first ones warm the client up
            if index == 20:
                began = time.process_time()
            await asyncio.to_thread(
                client.put_object,
                Bucket=BUCKET,
                Key=f"{self.prefix}-probe/{index}",
                Body=body,
                ContentType="application/json",
            )
        return (time.process_time() - began) / count

    def log_lines(self) -> int:
        return sum(server.logs().count("\n") for server in (self.api, self.worker))

    def completed_key(self) -> str:
        return self.keys.listing(TENANT, workflow_id=None, bucket="completed")

    def open_key(self) -> str:
        return self.keys.listing(TENANT, workflow_id=None, bucket="open")

    async def until_done(self, redis: Redis, completed: int, key: str, opened: str) -> int:
        """Wait until ``completed`` executions are listed completed and none open; the
        number of looks (each one round trip of two ZCARDs)."""
        deadline = time.perf_counter() + DONE_TIMEOUT
        polls = 0
        while True:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.zcard(key)
                pipe.zcard(opened)
                done, unfinished = await pipe.execute()
            polls += 1
            if int(done) >= completed and int(unfinished) == 0:
                return polls
            if time.perf_counter() > deadline:
                raise RuntimeError(
                    f"{completed - int(done)} executions not completed after {DONE_TIMEOUT:g} s "
                    f"({int(unfinished)} open)"
                )
            await asyncio.sleep(POLL)

    async def idle_share(self) -> float:
        """The API replica's and the worker's CPU share with nothing to do (info)."""
        usage = Usage([*descendants(self.api.pid), *descendants(self.worker.pid)], None)
        usage.begin()
        await asyncio.sleep(2)
        usage.end()
        return usage.server / usage.wall

    # --- accept: 202s per second -------------------------------------------------------

    async def rate(
        self,
        client: Worker,
        target: FlowcastServer,
        measured: list[FlowcastServer],
        *,
        redis: Redis | None = None,
    ) -> Cost:
        config = self.config
        usage = Usage([pid for s in measured for pid in descendants(s.pid)], self.valkey_pid)
        t0 = time.time() + config.starts_warmup
        t1 = t0 + config.starts_seconds

        async def window() -> None:
            await asyncio.sleep(max(t0 - time.time(), 0))
            usage.begin()
            await asyncio.sleep(max(t1 - time.time(), 0))
            usage.end()

        stats = await commandstats(redis) if redis is not None else None
        logged = self.log_lines()
        s3 = self.s3()
        answer, _ = await asyncio.gather(self.post(client, target, t0=t0, t1=t1), window())
        cost = self.cost(answer, usage, api=usage.server)
        cost.wall = config.starts_seconds
        cost.answered = answer["answered"]
        if redis is not None and stats is not None:
            # Over every request of the call, the warm-up's included (no worker runs).
            after = await commandstats(redis)
            cost.commands = +Counter(
                {n: c for n, c in (after.commands - stats.commands).items() if n != "info"}
            )
            cost.reads = after.reads - stats.reads - 1
            cost.logged = self.log_lines() - logged
            after_s3 = self.s3()
            cost.s3, cost.s3_cpu = after_s3[0] - s3[0], after_s3[1] - s3[1]
        return cost

    # --- the load ----------------------------------------------------------------------

    async def post(self, client: Worker, server: FlowcastServer, **bounds: float) -> dict[str, Any]:
        wait = bounds["t1"] - time.time() if "t1" in bounds else DONE_TIMEOUT
        return await client.ask(
            {
                "cmd": "posts",
                "path": PATH,
                "body": BODY,
                "ports": [server.port],
                "loops": self.clients,
                "timeout": 30,
                **bounds,
            },
            timeout=wait + 60,
        )

    def cost(
        self, answer: dict[str, Any], usage: Usage, *, api: float, worker: float = 0.0
    ) -> Cost:
        statuses = Counter(answer["statuses"])
        return Cost(
            count=statuses.get("202", 0),
            wall=usage.wall,
            server=api + worker,
            api=api,
            worker=worker,
            valkey=usage.store,
            client=answer["cpu"],
            busy=usage.busy,
            statuses=statuses,
            errors=Counter(answer["errors"]),
            durations=answer["durations"],
        )

    # --- where a start's Redis work goes ------------------------------------------------

    async def monitor(self, redis: Redis, client: Worker, count: int) -> Sample:
        """``count`` starts with MONITOR on: each command by sender and script."""
        names = script_names()
        ports = {
            "API replica": redis_ports(self.api.pid, self.stack.valkey.port),
            "worker": redis_ports(self.worker.pid, self.stack.valkey.port),
        }
        sample = Sample(count=count)
        completed, opened = self.completed_key(), self.open_key()
        before = int(await redis.zcard(completed))
        async with redis.monitor() as monitor:

            async def listen() -> None:
                async for entry in monitor.listen():
                    sample.see(entry, ports, names)

            task = asyncio.create_task(listen())
            try:
                answer = await self.post(client, self.api, count=count)
                accepted = int(answer["statuses"].get("202", 0))
                await self.until_done(redis, before + accepted, completed, opened)
                sample.count = accepted
                await asyncio.sleep(0.2)  # the last lines in
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        return sample

    # --- the table ---------------------------------------------------------------------

    def add_rows(
        self,
        bare: Cost,
        flowcast: Cost,
        bare_rate: Cost,
        accept: Cost,
        sample: Sample,
        calls: Calls,
    ) -> None:
        config, report = self.config, self.report
        rounds = config.starts_cost_rounds
        per, base = flowcast.per(flowcast.server), bare.per(bare.server)
        refused = sum(n for s, n in flowcast.statuses.items() if s != "202")
        report.add(
            Row(
                f"starts: server CPU per one-`transform` execution, accepted → completed "
                f"stored, API + worker ({flowcast.count:,} executions, {self.clients} clients)",
                f"{ms(per)} (API {ms(flowcast.per(flowcast.api))}, worker "
                f"{ms(flowcast.per(flowcast.worker))})",
                f"bare FastAPI: {ms(base)} per request",
                ratio(per, base),
                "≤ 4x",
                verdict(per <= 4 * base and not refused and not flowcast.errors),
            )
        )
        refused_rate = sum(n for s, n in accept.statuses.items() if s != "202")
        report.add(
            Row(
                f"starts: executions accepted per second, one API replica "
                f"(FLOWCAST_WORKER_SLOTS=0, no worker), {self.clients} clients",
                f"{accept.rate:,.0f}/s; CPU: server {accept.server / accept.wall:.0%}, client "
                f"{accept.client / accept.wall:.0%} of a core",
                f"bare FastAPI: {bare_rate.rate:,.0f}/s",
                ratio(accept.rate, bare_rate.rate),
                "≥ 0.5x",
                verdict(
                    accept.rate >= 0.5 * bare_rate.rate and not refused_rate and not accept.errors
                ),
            )
        )
        executions = max(flowcast.count, 1)
        commands = sum(flowcast.commands.values()) / executions
        trips = flowcast.reads / executions
        accepts = max(accept.answered, 1)
        api_commands = sum(accept.commands.values()) / accepts
        api_trips = accept.reads / accepts
        report.add(
            Row(
                "starts: Redis per execution, the same executions (info)",
                f"{trips:.1f} round trips, {commands:.1f} commands with those scripts run "
                f"(the API's accept: {api_trips:.1f} and {api_commands:.1f}); Valkey CPU "
                f"{ms(flowcast.per(flowcast.valkey))}",
                "bare FastAPI: none",
            )
        )
        top = ", ".join(
            f"{name} {n / max(flowcast.count, 1):.2f}"
            for name, n in flowcast.commands.most_common(12)
        )
        report.notes.append(
            f"starts-cost: an API replica (FLOWCAST_WORKER_SLOTS=0, uvicorn --backlog 8192), "
            f"one `flowcast worker` (64 slots) and the bare FastAPI endpoint "
            f"(bench/baseline_api.py, its own uvicorn process with the replica's options), "
            f"Redis prefix {self.prefix}, no API keys (one tenant), "
            "FLOWCAST_MAX_EXECUTIONS_PER_TENANT=0 and FLOWCAST_TENANT_STORAGE_BYTES=0 (the "
            "accept part leaves thousands queued). Load: one `bench/scale_client.py` "
            f"process, {self.clients} loops on keep-alive connections, `POST {PATH}` with "
            f"`{BODY}` as soon as the previous answer is in; Flowcast and the bare endpoint "
            f"take turns ({rounds} round(s) of each part, summed). With nothing to do the "
            f"replica and the worker use {self.idle:.1%} of a core (counted in the figures)."
        )
        report.notes.append(
            f"starts-cost, cost: {flowcast.count:,} executions accepted (answers "
            f"{dict(flowcast.statuses)}, errors {dict(flowcast.errors) or 'none'}), the "
            f"last completed {flowcast.wall:.1f} s after the first request "
            f"({flowcast.rate:,.0f}/s): API replica {flowcast.api:.2f} s of CPU, worker "
            f"{flowcast.worker:.2f} s, Valkey {flowcast.valkey:.2f} s, machine busy "
            f"{flowcast.busy:.0%}; client process {flowcast.client:.2f} s; request → 202 p50 "
            f"{ms(percentile(flowcast.durations or [0.0], 50))}, p99 "
            f"{ms(percentile(flowcast.durations or [0.0], 99))}. Bare endpoint: "
            f"{bare.count:,} requests in {bare.wall:.1f} s ({bare.rate:,.0f}/s), "
            f"{bare.server:.2f} s of CPU, client {bare.client:.2f} s; p50 "
            f"{ms(percentile(bare.durations or [0.0], 50))}. Redis per execution (INFO "
            "commandstats: the commands sent and those run by scripts, the looks for "
            f"completion taken off): {top}; round trips = "
            "Valkey's total_reads_processed (one read event per request or pipeline)."
        )
        report.notes.append(
            f"starts-cost, accept: the worker stopped; {config.starts_warmup:g} s of "
            f"warm-up, then {config.starts_seconds:g} s counted, {rounds} round(s): "
            f"{accept.count:,} answered 202 ({accept.rate:,.0f}/s; answers "
            f"{dict(accept.statuses)}, errors {dict(accept.errors) or 'none'}); API replica "
            f"CPU {accept.server / accept.wall:.0%} of a core ({ms(accept.per(accept.server))} "
            f"per accept), Valkey {accept.valkey / accept.wall:.0%}, machine busy "
            f"{accept.busy:.0%}, client {accept.client / accept.wall:.0%}; p50 "
            f"{ms(percentile(accept.durations or [0.0], 50))}, p99 "
            f"{ms(percentile(accept.durations or [0.0], 99))}. Bare endpoint: "
            f"{bare_rate.count:,} ({bare_rate.rate:,.0f}/s), its CPU "
            f"{bare_rate.server / bare_rate.wall:.0%} of a core "
            f"({ms(bare_rate.per(bare_rate.server))} per request), client "
            f"{bare_rate.client / bare_rate.wall:.0%}; p50 "
            f"{ms(percentile(bare_rate.durations or [0.0], 50))}."
        )
        report.notes.append(sample.note())
        api_cpu = accept.per(accept.server)
        worker_cpu = flowcast.per(flowcast.worker)
        worker_trips = trips - api_trips
        worker_commands = sample.sent_per("worker")
        api_sent = sample.sent_per("API replica")
        report.notes.append(
            "starts-cost, where a start's CPU goes (no profiler in the venv; by process, "
            "with Redis counted): the API replica's accept costs "
            f"{ms(api_cpu)} of CPU ({api_cpu / max(bare_rate.per(bare_rate.server), 1e-9):.1f}x "
            f"the bare request) for {api_trips:.1f} round trips and {api_sent:.1f} commands "
            "sent (INFO over the accept windows, warm-up included, no worker running; MONITOR "
            f"sample); the worker's run {ms(worker_cpu)} for about {worker_trips:.1f} round "
            f"trips and {worker_commands:.1f} commands sent; of the cost rounds' CPU "
            f"{flowcast.main / max(flowcast.server, 1e-9):.0%} was the two main processes' "
            "own (the rest: their helper processes). Measured in the bench process "
            f"(redis-py with the same parser, uvloop), a command sent alone costs "
            f"{calls.round_trip * 1e6:.0f} µs of client CPU and one more in a pipeline of "
            f"{calls.width} {calls.pipelined * 1e6:.0f} µs: at those rates the round trips "
            f"and commands alone would be about {ms(calls.estimate(api_trips, api_sent))} "
            f"of the accept and {ms(calls.estimate(worker_trips, worker_commands))} of the "
            f"run. Log lines written: {accept.logged / accepts:.2f} per accept, "
            f"{flowcast.logged / executions:.2f} per execution (API + worker). "
            + self.s3_note(flowcast, accept, executions, accepts, calls)
        )

    def s3_note(
        self, flowcast: Cost, accept: Cost, executions: int, accepts: int, calls: Calls
    ) -> str:
        if self.moto is None:
            return "Values in each process's directory (no S3 value store)."

        def per(requests: Counter[str], count: int) -> str:
            if not requests:
                return "none"
            return ", ".join(f"{m} {n / count:.2f}" for m, n in requests.most_common())

        puts = flowcast.s3.get("PUT", 0) / executions
        measured = (
            f"; one small PUT made as lib/execution/s3.py makes it (boto3 in a thread) costs "
            f"{ms(calls.s3_put)} of client CPU in the bench process, so the PUTs alone would "
            f"be about {ms(puts * calls.s3_put)} of each execution"
            if calls.s3_put
            else ""
        )
        return (
            "Requests to the S3 value store (moto's access log; moto's own CPU is not in "
            f"the server's figure): per execution {per(flowcast.s3, executions)} "
            f"(moto {ms(flowcast.per(flowcast.s3_cpu))} of CPU each), per accept "
            f"{per(accept.s3, accepts)}{measured}."
        )


def script_names() -> dict[str, str]:
    """Every Lua script's SHA (as ``register`` loads it, with the prelude) → its file."""
    names = {}
    for path in sorted((ROOT / "lib").rglob("*.lua")) + sorted((ROOT / "app").rglob("*.lua")):
        if path.name == "prelude.lua":
            continue
        package = ".".join(path.parent.relative_to(ROOT).parts)
        with contextlib.suppress(Exception):
            text = script_source(package, path.name)
            names[hashlib.sha1(text.encode()).hexdigest()] = path.name
    return names


@dataclass
class Calls:
    """What redis-py costs this process per command: sent alone (a round trip of its
    own) and one more in a pipeline of ``width``."""

    round_trip: float  # CPU seconds
    pipelined: float
    width: int
    s3_put: float | None = None  # one small PUT to the value store (boto3)

    def estimate(self, trips: float, commands: float) -> float:
        return trips * self.round_trip + max(commands - trips, 0) * self.pipelined


async def client_costs(redis: Redis, count: int = 4_000, width: int = 16) -> Calls:
    """``Calls`` measured with ``EXISTS`` of a missing key (CPU time of this process)."""
    key = f"{PREFIX}:probe"
    began = time.process_time()
    for _ in range(count):
        await redis.exists(key)
    alone = (time.process_time() - began) / count
    began = time.process_time()
    for _ in range(count // width):
        async with redis.pipeline(transaction=False) as pipe:
            for _ in range(width):
                pipe.exists(key)
            await pipe.execute()
    batch = (time.process_time() - began) / (count // width)
    return Calls(alone, max(batch - alone, 0.0) / (width - 1), width)


@dataclass
class Stats:
    commands: Counter[str]
    reads: int


async def commandstats(redis: Redis) -> Stats:
    """Calls per command so far, and Valkey's read events (in one round trip)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.info("commandstats")
        pipe.info("stats")
        by_command, stats = await pipe.execute()
    commands: Counter[str] = Counter(
        {name.removeprefix("cmdstat_"): int(values["calls"]) for name, values in by_command.items()}
    )
    return Stats(commands, int(stats["total_reads_processed"]))


@dataclass
class Sample:
    """Commands seen by MONITOR while ``count`` starts ran, by sender."""

    count: int
    sent: dict[str, Counter[str]] = field(default_factory=dict)  # sender → command
    in_scripts: Counter[str] = field(default_factory=Counter)

    def see(self, entry: dict[str, Any], ports: dict[str, set[int]], names: dict[str, str]) -> None:
        words = entry["command"].split(" ", 2)
        name = words[0].upper()
        if entry["client_type"] == "lua":
            self.in_scripts[name] += 1
            return
        if name in ("EVALSHA", "EVAL") and len(words) > 1:
            name = names.get(words[1], f"EVALSHA {words[1][:8]}")
        port = int(entry["client_port"]) if entry["client_port"].isdigit() else -1
        sender = next((who for who, held in ports.items() if port in held), "other")
        self.sent.setdefault(sender, Counter())[name] += 1

    def sent_per(self, sender: str) -> float:
        return sum(self.sent.get(sender, Counter()).values()) / max(self.count, 1)

    def note(self) -> str:
        count = max(self.count, 1)
        parts = []
        for sender in ("API replica", "worker", "other"):
            seen = self.sent.get(sender)
            if not seen:
                continue
            total = sum(seen.values())
            top = ", ".join(f"{name} {n / count:.2f}" for name, n in seen.most_common(14))
            parts.append(f"{sender} {total / count:.1f} per start ({top})")
        inside = sum(self.in_scripts.values())
        return (
            f"starts-cost, where a start's Redis work goes: {self.count} starts with MONITOR "
            "on (after the measured runs), each command sent counted by the process that "
            "sent it (its connection's port in /proc) and each script call by its file: "
            + "; ".join(parts)
            + f"; commands run inside scripts {inside / count:.1f} per start ("
            + ", ".join(f"{n} {c / count:.1f}" for n, c in self.in_scripts.most_common(8))
            + "). 'other' is the bench's own looks for completion."
        )
