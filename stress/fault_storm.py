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
close, collects what the store holds, and ``stress/fault_checks.py`` judges it all. The
plan is drawn in ``stress/fault_plan.py``; the readers, answers and replicas are in
``stress/fault_records.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from stress.fault_checks import judge
from stress.fault_plan import (
    BUDGET_BYTES,
    CYCLE,
    GRACE_SECONDS,
    LEASE_SECONDS,
    LONG,
    MAX_PENDING_EVENTS,
    ODD_CURSOR,
    SHORT,
    Shape,
    make_plans,
    storm_workflows,
)
from stress.fault_records import Answer, Fault, Reader, Replicas, Run
from stress.harness import Budget, Report, bounded, clock
from stress.recoveries import running_owners
from tests.support import faults
from tests.support.faults import FaultyValkey
from tests.support.logcheck import TERMINAL

PREFIX = "fc"
COLLECT_SECONDS = 60

log = logging.getLogger(__name__)


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
                stop_sampling = asyncio.Event()
                sampler = asyncio.create_task(self._sample_forever(stop_sampling))
                try:
                    await bounded(self.report, self._load(streams))
                    self.load_ended_wall = time.time()
                    log.info("load over in %.1f s; settling", self.report.seconds)
                    await self._settle()
                    log.info("settled; waiting for the streams")
                    await self._wait_streams()
                finally:
                    stop_sampling.set()
                    await sampler
            log.info("collecting the stored logs")
            async with asyncio.timeout(COLLECT_SECONDS):
                await self._collect()
            self.dump(self.root / "fault-storm.json")
            log.info("collected")
        finally:
            try:
                await self.live.close()
            finally:
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
            following = owner.follow(run, self.live, self.report, request)
            self._reader_tasks.append(streams.create_task(following))
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
            following = reader.follow(run, self.live, self.report)
            self._reader_tasks.append(streams.create_task(following))
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
                run.accept(response.json()["executionId"], sent, slot.server.port)
                return
            if response.status_code != 503:
                problem = f"{response.status_code}: {response.text[:200]}"
                self.start_problems.append(f"execute {run.workflow_id} answered {problem}")
                return
            await asyncio.sleep(0.2)
        run.started.set()

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
            for _ in range(10):  # as a client would, again after a 503 or no answer
                if await self.status(run, rng) != "paused":
                    return
                await self.fire(run, rng, "sweep", resumes=0, cancels=1)
                if run.answers[-1].status in (202, 409):
                    return
                await asyncio.sleep(0.3)

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
                # The data is as of SAVE, not of its return: what was acknowledged while
                # it ran, or while the file was copied, may be missing from it.
                snapshot = (await faults.take_snapshot(self.valkey, path), fault.began_wall)
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
                index, fault.owned = await self._busiest()
                port = self.live.slots[index].server.port
                fault.detail = f"replica {index}, port {port}, {len(fault.owned)} running there"
                work = (
                    self.live.kill(index, argument)
                    if kind == "replica-kill"
                    else self.live.terminate(index)
                )
                self._replica_fault(fault, work)
                continue
            fault.ended, fault.ended_wall = clock(), time.time()
        await asyncio.gather(*self._background)

    async def _busiest(self) -> tuple[int, list[str]]:
        """The slot whose process owns the most running executions, and those: the
        replica to kill or stop (a random one if Valkey cannot say right now)."""
        redis = Redis.from_url(self.valkey.url, socket_timeout=2)
        try:
            accepted = {run.execution_id: run.port for run in self.accepted}
            owners = await running_owners(redis, accepted)
        except (RedisError, OSError):
            return self.rng.randrange(2), []
        finally:
            await redis.aclose()
        counts = [len(owners.get(slot.server.port, [])) for slot in self.live.slots]
        busiest = [index for index, count in enumerate(counts) if count == max(counts)]
        index = self.rng.choice(busiest)
        return index, owners.get(self.live.slots[index].server.port, [])

    def _replica_fault(self, fault: Fault, work: Any) -> None:
        # A replica fault runs beside the next ones: a drain takes the grace period.
        async def run() -> None:
            # The signal goes out as soon as ``work`` starts: when it was sent, to the ms.
            fault.began, fault.began_wall = clock(), time.time()
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

    async def _sample_forever(self, done: asyncio.Event) -> None:
        """Sample every second until ``done`` is set. Stopped by a flag, not a cancel:
        redis-py can swallow a cancel that lands inside a pipeline (seen with 8.1), and
        this loop would then sample on forever with the storm waiting for it."""
        redis = Redis.from_url(self.valkey.url, socket_timeout=5)
        try:
            while not done.is_set():
                try:
                    await self._sample(redis)
                except (RedisError, OSError):
                    pass  # Valkey is down or asleep: the next sample
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1):
                        await done.wait()
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
    shape = LONG if long else SHORT
    report = Report("fault-storm", Budget(seconds=shape.seconds, requests=shape.requests))
    report.data_dir = root
    storm = Storm(root, shape, seed, report)
    await storm.run()
    judge(storm)
    return report
