"""The queue storm: a flood and a steady tenant on the fair queue while workers are
SIGKILLed and restarted (SPEC §7 "Recovery", "Shutdown hands work off", §14).

An API replica that runs no work (``FLOWCAST_WORKER_SLOTS=0``) and three ``flowcast
worker`` processes (``SLOTS`` slots each, lease 1 s, grace 1 s) share one Valkey with
AOF; two API keys are two tenants of equal weight (``FLOWCAST_TENANT_WEIGHTS``). The
*heavy* tenant floods: a burst at once, then its line kept at ``heavy_level`` queued,
spread round robin over ``SPREAD`` workflows. The *light* tenant, on two workflows,
starts one execution at a steady pace for the first half of the window (phase A: its
waits), then keeps a small line of its own (phase B: both backlogged, the share of
starts). The workflows are short: a ``transform``, then a ``delay`` or a streaming
``generate``, then a ``transform`` that echoes the first block's output. Every execution
is followed to its end by one SSE client on the API replica (a third of the light ones
by a streaming execute, which shows ``queue`` frames while it waits).

Meanwhile, kill cycles (``Shape.kills``): the worker with the most slots in use (its
``/metrics``) is SIGKILLed and a fresh worker started on its data directory, at once or
a lease and a half later (so the others recover its runs by lease, or the fresh one by
its node record); one cycle in every ``Shape.term_every`` (the middle one) a SIGTERM
instead (drain and hand-off). A cycle that runs late (a slow restart) delays the next,
and the load goes on until the last one is over. What the lost worker owned is read
from Valkey right after the signal (the ``owner`` field of each unfinished execution,
by the node ids the workers write in their data directories). The verdict is
``stress/queue_checks.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from app.auth import tenant_of_key
from lib.backend import Keys
from lib.execution.ownership import node_of
from stress.harness import Budget, Report, View, bounded, clock, counting, follow, judging
from stress.queue_checks import QueueVerdict
from stress.queue_keys import Leftovers, queue_keys
from stress.queue_plan import (
    GRACE_SECONDS,
    LEASE_SECONDS,
    LONG,
    SHORT,
    SLOTS,
    SPREAD,
    WORKERS,
    Execution,
    Loss,
    Shape,
    WorkerSlot,
    queue_workflows,
)
from tests.support.servers import ALPHA, BETA, FlowcastServer, FlowcastWorker, ValkeyServer

HEAVY, LIGHT = ALPHA, BETA  # the two tenants' API keys
PREFIX = "fcqs"
MAX_RECOVERIES = 10  # a run may live through many kills; quarantine is blame.py's
FOLLOW_SECONDS = 120.0  # a client with no terminal event by then is stuck
SAMPLE_SECONDS = 0.1  # how often the lines' lengths are read
SLOTS_USED = re.compile(r"^flowcast_worker_slots_used (\S+)$", re.MULTILINE)


class QueueStorm:
    """Runs the processes, the load and the kill cycles, then hands over to the verdict."""

    def __init__(self, root: Path, shape: Shape, seed: int, report: Report) -> None:
        self.root = root
        self.shape = shape
        self.report = report
        self.seed = seed
        self.rng = random.Random(seed)
        self.valkey = ValkeyServer(data_dir=root / "valkey")
        self.keys = Keys(PREFIX)
        self.tenants = {"heavy": tenant_of_key(HEAVY), "light": tenant_of_key(LIGHT)}
        self.workflows = {
            "heavy": queue_workflows("h", SPREAD),
            "light": queue_workflows("l", 2),
        }
        self.executions: list[Execution] = []
        self.losses: list[Loss] = []
        self.samples: list[tuple[float, int, int]] = []  # wall, heavy queued, light queued
        self.refused: list[str] = []
        self.most_used = 0.0  # the most slots in use seen on one worker
        self.load_max = 0.0  # the machine's highest 1-minute load average seen
        self._cycles_done = False
        # (wall clock, workers up from then on): the slots the run really had.
        self.live: list[tuple[float, int]] = []
        self.api: FlowcastServer | None = None
        self.workers: list[WorkerSlot] = []
        self.every_worker: list[FlowcastWorker] = []
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.began = 0.0
        self.began_wall = 0.0
        self.ended_wall = 0.0
        self.redis: Redis | None = None
        self.leftovers: Leftovers | None = None  # the queue's keys once all ended
        self._followers: list[asyncio.Task[View]] = []

    def env(self) -> dict[str, str]:
        empty = self.root / "workflows"
        empty.mkdir(parents=True, exist_ok=True)
        weights = {tenant: 1 for tenant in self.tenants.values()}
        return {
            "FLOWCAST_REDIS_URL": self.valkey.url,
            "FLOWCAST_REDIS_PREFIX": PREFIX,
            "FLOWCAST_WORKFLOWS_DIR": str(empty),
            "FLOWCAST_API_KEYS": f"{HEAVY},{LIGHT}",
            "FLOWCAST_TENANT_WEIGHTS": json.dumps(weights),
            "FLOWCAST_SECRET_KEY": "queue-storm-" + "s" * 32,  # the processes share it
            "FLOWCAST_MAX_STREAMS_PER_TENANT": "0",
            "FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "5000",
            "FLOWCAST_LEASE_SECONDS": str(LEASE_SECONDS),
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": str(GRACE_SECONDS),
            "FLOWCAST_MAX_RECOVERIES": str(MAX_RECOVERIES),
            "FLOWCAST_SSE_PING_SECONDS": "1",
            "FLOWCAST_LOG_LEVEL": "warning",
        }

    # -- processes -------------------------------------------------------------------

    async def run(self) -> None:
        await self.valkey.start()
        env = self.env()
        self.redis = Redis.from_url(self.valkey.url, socket_timeout=10)
        self.api = FlowcastServer(
            data_dir=self.root / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"}
        )
        try:
            self.workers = [
                WorkerSlot(n, self._worker(self.root / f"worker-{n}")) for n in range(WORKERS)
            ]
            await asyncio.gather(self.api.start(), *(self._start(w) for w in self.workers))
            count, judge = counting(self.report), judging(self.report)
            for name, key in (("heavy", HEAVY), ("light", LIGHT)):
                self.clients[name] = httpx.AsyncClient(
                    base_url=self.api.url,
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=httpx.Timeout(30, read=15),
                    limits=httpx.Limits(max_connections=600, max_keepalive_connections=100),
                    event_hooks={"request": [count], "response": [judge]},
                )
                for workflow in self.workflows[name]:
                    answer = await self.clients[name].put(
                        f"/api/workflows/{workflow['id']}", json=workflow
                    )
                    answer.raise_for_status()
            await bounded(self.report, self._load())
            await self._collect()
            self.leftovers = await queue_keys(self.redis, self.keys)
        finally:
            await self._close()

    def _worker(self, data_dir: Path) -> FlowcastWorker:
        worker = FlowcastWorker(
            data_dir=data_dir, env={**self.env(), "FLOWCAST_WORKER_SLOTS": str(SLOTS)}
        )
        self.every_worker.append(worker)
        return worker

    async def _start(self, slot: WorkerSlot) -> None:
        await slot.server.start()
        # The node record names this process first (app/node.py) once it serves.
        record = json.loads((slot.server.data_dir / "node.json").read_text())
        slot.node, slot.state = record["nodes"][0], "up"
        self.live.append((time.time(), sum(w.state == "up" for w in self.workers)))

    async def _close(self) -> None:
        async def stop(server: FlowcastServer) -> None:
            pid = server.pid
            try:
                await server.stop(signal.SIGTERM, timeout=GRACE_SECONDS + 10)
            except subprocess.TimeoutExpired as exc:
                self.report.find(f"process on port {server.port} did not exit: {exc}")
                os.kill(pid, signal.SIGKILL)

        for task in self._followers:
            task.cancel()
        await asyncio.gather(*(self._followers), return_exceptions=True)
        await asyncio.gather(*(client.aclose() for client in self.clients.values()))
        # Every worker process still running (a start cut short by the budget included).
        servers = [w for w in self.every_worker if w._process is not None]
        await asyncio.gather(*(stop(s) for s in [*servers, *([self.api] if self.api else [])]))
        if self.redis is not None:
            await self.redis.aclose()
        await self.valkey.stop()

    # -- the load --------------------------------------------------------------------

    async def _load(self) -> None:
        self.began, self.began_wall = clock(), time.time()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._sample())
            group.create_task(self._heavy())
            group.create_task(self._light())
            group.create_task(self._chaos())
        self.ended_wall = time.time()
        # Every client to its end: the lines drain once nothing more is posted.
        await asyncio.gather(*self._followers, return_exceptions=True)

    def _left(self) -> float:
        """Seconds of load left: the window, and longer while kill cycles are left."""
        left = self.shape.window - (clock() - self.began)
        return left if self._cycles_done else max(left, 0.1)

    def _phase(self) -> str:
        return "A" if clock() - self.began < self.shape.window / 2 else "B"

    async def _sample(self) -> None:
        """The lengths of both tenants' lines, every SAMPLE_SECONDS, for the share."""
        assert self.redis is not None
        heavy, light = (self.keys.queued(self.tenants[t]) for t in ("heavy", "light"))
        looks = 0
        while self._left() > 0:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zcard(heavy)
                pipe.zcard(light)
                h, lt = await pipe.execute()
            self.samples.append((time.time(), int(h), int(lt)))
            looks += 1
            if looks % 10 == 0:  # how busy the machine is (shared with other work)
                self.load_max = max(self.load_max, os.getloadavg()[0])
            if looks % 5 == 0:  # the workers' slots in use, every half second
                used = await asyncio.gather(*(self._slots_used(w) for w in self.workers))
                self.most_used = max(self.most_used, *used)
            await asyncio.sleep(SAMPLE_SECONDS)

    async def _queued(self, tenant: str) -> int:
        assert self.redis is not None
        return int(await self.redis.zcard(self.keys.queued(self.tenants[tenant])))

    async def _heavy(self) -> None:
        """A burst, then the line kept at ``heavy_level``, round robin over SPREAD
        workflows, eight posts at a time."""
        gate = asyncio.Semaphore(8)
        number = 0

        async def post_many(count: int) -> None:
            nonlocal number
            batch = []
            for _ in range(count):
                workflow = self.workflows["heavy"][number % SPREAD]
                batch.append(self._post("heavy", workflow, number, gate))
                number += 1
            await asyncio.gather(*batch)

        await post_many(self.shape.flood)
        while self._left() > 0:
            short = self.shape.heavy_level - await self._queued("heavy")
            if short > 0:
                await post_many(short)
            await asyncio.sleep(0.1)

    async def _light(self) -> None:
        """Phase A: one start every ``light_interval`` (jittered); phase B: its line kept
        at ``light_level``."""
        gate = asyncio.Semaphore(8)
        number = 0
        while self._left() > 0:
            if self._phase() == "A":
                workflow = self.workflows["light"][number % 2]
                streaming = number % 3 == 0
                asyncio.get_running_loop().create_task(
                    self._post("light", workflow, number, gate, streaming=streaming)
                )
                number += 1
                await asyncio.sleep(self.shape.light_interval * self.rng.uniform(0.5, 1.5))
                continue
            short = self.shape.light_level - await self._queued("light")
            posts = []
            for _ in range(max(0, short)):
                posts.append(self._post("light", self.workflows["light"][number % 2], number, gate))
                number += 1
            await asyncio.gather(*posts)
            await asyncio.sleep(0.05)

    async def _post(
        self,
        tenant: str,
        workflow: dict[str, Any],
        number: int,
        gate: asyncio.Semaphore,
        *,
        streaming: bool = False,
    ) -> None:
        """Start one execution and follow it on the API replica with one SSE client."""
        execution = Execution(tenant, self._phase(), workflow, number)
        client = self.clients[tenant]
        url = f"/api/workflows/{workflow['id']}/execute"
        body = {"input": {"n": number}}
        execution.posted_wall = time.time()
        if streaming:
            view = View("")
            execution.view = view
            self.executions.append(execution)
            task = asyncio.get_running_loop().create_task(
                follow([client], view, self.report, deadline=FOLLOW_SECONDS,
                       request=("POST", url, body))
            )  # fmt: skip
            self._followers.append(task)
            return
        async with gate:
            answer = await client.post(url, json=body)
        if answer.status_code != 202:
            self.refused.append(f"{tenant} execute answered {answer.status_code}: {answer.text}")
            return
        execution.execution_id = answer.json()["executionId"]
        execution.view = View(execution.execution_id)
        self.executions.append(execution)
        task = asyncio.get_running_loop().create_task(
            follow([client], execution.view, self.report, deadline=FOLLOW_SECONDS)
        )
        self._followers.append(task)

    # -- the kill cycles -------------------------------------------------------------

    async def _chaos(self) -> None:
        """Every cycle at its time, or as soon as two workers are up again when restarts
        run late (the load goes on until the last cycle and its restart are over)."""
        restarts: list[asyncio.Task[None]] = []
        try:
            for number, at in enumerate(self.shape.cycle_times()):
                await asyncio.sleep(max(0.0, self.began + at - clock()))
                while sum(slot.state == "up" for slot in self.workers) < 2:
                    await asyncio.sleep(0.05)
                term = number % self.shape.term_every == self.shape.term_every // 2
                restarts.append(await self._cycle("term" if term else "kill"))
            await asyncio.gather(*restarts)
        finally:
            self._cycles_done = True

    async def _cycle(self, kind: str) -> asyncio.Task[None]:
        """Lose the busiest worker; returns the start of a fresh one on its data
        directory (at once, or a lease and a half later after a SIGKILL)."""
        used = await asyncio.gather(*(self._slots_used(slot) for slot in self.workers))
        busiest = max(used)
        index = self.rng.choice([n for n, u in enumerate(used) if u == busiest])
        slot = self.workers[index]
        loss = Loss(kind, index, slot.node, busiest, at=clock() - self.began)
        self.losses.append(loss)
        server = slot.server
        slot.state = "down"
        self.live.append((time.time(), sum(w.state == "up" for w in self.workers)))
        if kind == "kill":
            loss.owned = await self._owned(slot.node)  # just before: it may end one meanwhile
            os.kill(server.pid, signal.SIGKILL)
            loss.signalled_wall = time.time()
            # Exactly what it held as it died: none of its leases can run out this soon.
            loss.owned = sorted(set(loss.owned) | set(await self._owned(slot.node)))
            await server.stop(signal.SIGKILL, timeout=10)  # reaps it
            # At once (the fresh process proves it dead: its node record) or after the
            # others had the time to recover its runs by their leases.
            loss.restart_after = self.rng.choice((0.0, 1.5 * LEASE_SECONDS))
        else:
            loss.owned = await self._owned(slot.node)
            loss.signalled_wall, pid = time.time(), server.pid
            try:
                await server.stop(signal.SIGTERM, timeout=GRACE_SECONDS + 15)
            except subprocess.TimeoutExpired as exc:
                self.report.find(f"worker {slot.node} did not exit after SIGTERM: {exc}")
                os.kill(pid, signal.SIGKILL)
        loss.exited_wall = time.time()
        return asyncio.get_running_loop().create_task(self._restart(slot, loss.restart_after))

    async def _restart(self, slot: WorkerSlot, after: float) -> None:
        await asyncio.sleep(after)
        slot.server = self._worker(slot.server.data_dir)
        await self._start(slot)

    async def _slots_used(self, slot: WorkerSlot) -> float:
        if slot.state != "up":
            return -1.0
        try:
            async with httpx.AsyncClient(
                base_url=slot.server.url, timeout=5, headers={"Authorization": f"Bearer {HEAVY}"}
            ) as client:
                text = (await client.get("/metrics")).text
        except httpx.HTTPError:
            return -1.0
        found = SLOTS_USED.search(text)
        return float(found.group(1)) if found else -1.0

    async def _owned(self, node: str) -> list[str]:
        """The unfinished executions whose owner is ``node``, read from Valkey."""
        assert self.redis is not None
        ids = [
            e.view.execution_id  # a streaming execute's: known from its first frame
            for e in self.executions
            if e.view is not None and e.view.execution_id and not e.view.finished
        ]
        async with self.redis.pipeline(transaction=False) as pipe:
            for execution_id in ids:
                pipe.hmget(self.keys.meta(execution_id), "owner", "status")
            rows = await pipe.execute()
        return [
            eid
            for eid, (owner, status) in zip(ids, rows, strict=True)
            if owner and node_of(owner.decode()) == node and status == b"running"
        ]

    # -- the ends --------------------------------------------------------------------

    async def _collect(self) -> None:
        """Every execution's stored log, read through the API replica."""
        gate = asyncio.Semaphore(16)

        async def read(execution: Execution) -> None:
            if not execution.execution_id and execution.view is not None:
                execution.execution_id = execution.view.execution_id
            if not execution.execution_id:
                return
            client = self.clients[execution.tenant]
            async with gate:
                execution.log = await stored_events(client, execution.execution_id)
            self.report.stored_events += len(execution.log)

        await asyncio.gather(*(read(e) for e in self.executions))


async def stored_events(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    """Every page of ``/events``."""
    found: list[dict[str, Any]] = []
    after = 0
    while True:
        answer = await client.get(
            f"/api/executions/{execution_id}/events", params={"after": after, "limit": 1000}
        )
        answer.raise_for_status()
        page = answer.json()
        found += page["events"]
        if not page["events"]:
            return found
        after = page["nextAfter"]


async def queue_storm(root: Path, *, long: bool = False, seed: int = 20261129) -> Report:
    """A flood and a steady tenant on the fair queue under worker kill cycles; see the
    module docstring."""
    shape = LONG if long else SHORT
    per_second = WORKERS * SLOTS / 0.8 + 20  # starts, streams and the checks' reads
    requests = int(shape.window * per_second * 4 + shape.flood * 6 + 2000)
    report = Report("queue-storm", Budget(seconds=shape.seconds, requests=requests))
    report.data_dir = root
    storm = QueueStorm(root, shape, seed, report)
    await storm.run()
    QueueVerdict(storm).judge()
    return report
