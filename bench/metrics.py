"""Each metric of SPEC section 11, measured next to its baseline."""

from __future__ import annotations

import asyncio
import math
import resource
import secrets
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from bench.clients import LatencyRecorder, SSEClient, http_request, open_stream
from bench.floor import Floor
from bench.queue import QueueBench
from bench.recovery import Recovery
from bench.report import Report, Row, ms, percentile, rate, ratio, verdict
from bench.rss import peak_rss, status_bytes
from bench.scale import Scale
from bench.stack import OWN_SERVER, SSE, Config, GiB, MiB, Stack, words, workflows
from bench.starts_cost import StartsCost
from tests.support.servers import FlowcastServer

# --- the bench ---------------------------------------------------------------------


class Bench:
    def __init__(self, stack: Stack, config: Config, report: Report) -> None:
        self.stack = stack
        self.config = config
        self.report = report
        self.http = httpx.AsyncClient(base_url=stack.a.url, timeout=60)

    async def close(self) -> None:
        await self.http.aclose()

    async def setup(self) -> None:
        for workflow in workflows(self.config):
            if workflow["id"] in OWN_SERVER:
                continue
            response = await self.http.put(f"/api/workflows/{workflow['id']}", json=workflow)
            response.raise_for_status()

    async def start(self, workflow_id: str, payload: Any, *, server: str | None = None) -> str:
        url = f"{server or self.stack.a.url}/api/workflows/{workflow_id}/execute"
        response = await self.http.post(url, json={"input": payload})
        response.raise_for_status()
        execution_id: str = response.json()["executionId"]
        return execution_id

    async def wait_status(
        self, execution_id: str, statuses: set[str], *, timeout: float, server: str | None = None
    ) -> dict[str, Any]:
        url = f"{server or self.stack.a.url}/api/executions/{execution_id}"
        async with asyncio.timeout(timeout):
            while True:
                snapshot: dict[str, Any] = (await self.http.get(url)).json()
                if snapshot["status"] in statuses:
                    return snapshot
                await asyncio.sleep(0.05)

    async def stream(
        self,
        port: int,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        on_frames: Callable[[list[bytes], float], None] | None = None,
        timeout: float = 120,
    ) -> tuple[SSEClient, float]:
        """Open one SSE request, read it to its end; returns the client and its start."""
        request = http_request(
            method, path, port=port, headers={**SSE, **(headers or {})}, json=json
        )
        started = time.perf_counter()
        client = await open_stream(port, request, on_frames)
        await asyncio.wait_for(client.done, timeout)
        if client.status != 200:
            raise RuntimeError(f"{method} {path} answered {client.status}")
        return client, started

    # --- the store's ceiling ---------------------------------------------------------

    async def xadd(self) -> float | None:
        binary = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
        if binary is None:
            self.report.notes.append(
                "redis-benchmark not found (Debian: `apt-get install -y redis-tools`); "
                "the store ceiling is not measured."
            )
            return None
        value = "x" * 200  # about the size of one chunk event's envelope
        command = [
            binary, "-h", "127.0.0.1", "-p", str(self.stack.valkey.port),
            "-n", str(self.config.xadd_requests), "-P", "16", "--csv",
            "XADD", "bench:xadd", "*", "data", value,
        ]  # fmt: skip
        result = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=120
        )
        async with Redis.from_url(self.stack.valkey.url) as redis:
            await redis.delete("bench:xadd")
        lines = [line for line in result.stdout.splitlines() if line.startswith('"XADD')]
        if not lines:
            self.report.notes.append(f"redis-benchmark gave no figure: {result.stderr[-300:]}")
            return None
        rps = float(lines[-1].split('","')[1])
        self.report.notes.append(
            f"Store ceiling: `{Path(binary).name} -n {self.config.xadd_requests} -P 16 -c 50 "
            f"XADD bench:xadd '*' data <200 bytes>` against the same Valkey: {rps:,.0f} XADD/s."
        )
        return rps

    # --- metrics ---------------------------------------------------------------------

    async def ttfe(self) -> None:
        a, base = self.stack.a.port, self.stack.baseline.port
        flowcast: list[float] = []
        plain: list[float] = []

        async def once(port: int, path: str, into: list[float] | None) -> None:
            client, started = await self.stream(port, "POST", path, json={"input": {}})
            assert client.first_frame_at is not None
            if into is not None:
                into.append(client.first_frame_at - started)

        for _ in range(5):  # warm both up
            await once(a, "/api/workflows/bench-ttfe/execute", None)
            await once(base, "/execute", None)
        for _ in range(self.config.ttfe_runs):
            await once(a, "/api/workflows/bench-ttfe/execute", flowcast)
            await once(base, "/execute", plain)
        for pct in (50, 99):
            f, p = percentile(flowcast, pct), percentile(plain, pct)
            self.report.add(
                Row(
                    f"TTFE p{pct} ({len(flowcast)} runs)",
                    ms(f),
                    ms(p),
                    ratio(f, p),
                    "< 10 ms" if pct == 50 else "—",
                    verdict(f < 0.010) if pct == 50 else "—",
                )
            )

    async def sl(self) -> None:
        count = self.config.sl_events
        execution_id = await self.start("bench-sl", {"text": words(count)})
        path = f"/api/executions/{execution_id}/stream"
        via_b, via_a = LatencyRecorder(), LatencyRecorder()
        timeout = count / 100 + 30
        await asyncio.gather(
            self.stream(self.stack.b.port, "GET", path, on_frames=via_b, timeout=timeout),
            self.stream(self.stack.a.port, "GET", path, on_frames=via_a, timeout=timeout),
        )
        plain = LatencyRecorder()
        await self.stream(
            self.stack.baseline.port,
            "GET",
            f"/paced?n={count}&rate=100",
            on_frames=plain,
            timeout=timeout,
        )
        for recorder, where in ((via_b, "B"), (via_a, "A")):
            if len(recorder.latencies) != count:
                self.report.notes.append(
                    f"SL: the client on {where} got {len(recorder.latencies)} of {count} chunks."
                )
        for pct in (50, 99):
            f, p = percentile(via_b.latencies, pct), percentile(plain.latencies, pct)
            self.report.add(
                Row(
                    f"SL p{pct}, reader on another process ({count} ev at 100/s)",
                    ms(f),
                    ms(p),
                    ratio(f, p),
                    "< 10 ms" if pct == 99 else "—",
                    verdict(f < 0.010) if pct == 99 else "—",
                )
            )
        f = percentile(via_a.latencies, 99)
        self.report.add(
            Row(
                "SL p99, reader on the owner process (info)",
                ms(f),
                ms(percentile(plain.latencies, 99)),
                ratio(f, percentile(plain.latencies, 99)),
            )
        )

    async def so(self) -> None:
        # 300 words at 100/s: the first at 0 s, the last on schedule at 2.99 s.
        window = 2.99
        flowcast: list[float] = []
        plain: list[float] = []
        text = words(300)
        for _ in range(self.config.so_runs):
            client, started = await self.stream(
                self.stack.a.port,
                "POST",
                "/api/workflows/bench-so/execute",
                json={"input": {"text": text}},
                timeout=30,
            )
            assert client.last_frame_at is not None
            flowcast.append(client.last_frame_at - started - window)
            client, started = await self.stream(
                self.stack.baseline.port, "GET", "/paced?n=300&rate=100", timeout=30
            )
            assert client.last_frame_at is not None
            plain.append(client.last_frame_at - started - window)
        f, p = percentile(flowcast, 50), percentile(plain, 50)
        self.report.add(
            Row(
                f"SO p50 (max), 300 words at 100/s, {len(flowcast)} runs",
                f"{ms(f)} ({ms(max(flowcast))})",
                f"{ms(p)} ({ms(max(plain))})",
                f"+{(f - p) * 1000:.1f} ms",
                "< 50 ms",
                verdict(f < 0.050),
            )
        )

    async def throughput(self, xadd_rps: float | None) -> None:
        count = self.config.burst_events
        text = words(count)
        delivered: list[float] = []
        stored: list[float] = []
        plain: list[float] = []
        for _ in range(self.config.burst_runs):
            wall = time.time()
            client, _ = await self.stream(
                self.stack.a.port,
                "POST",
                "/api/workflows/bench-burst/execute",
                json={"input": {"text": text}},
                timeout=300,
            )
            delivered.append(burst_rate(client))
            snapshot = await self.wait_status(
                client.headers["x-execution-id"], {"completed", "failed"}, timeout=120
            )
            finished = datetime.fromisoformat(snapshot["updatedAt"]).timestamp()
            stored.append(snapshot["lastEventId"] / max(finished - wall, 1e-3))
            client, _ = await self.stream(
                self.stack.baseline.port, "GET", f"/burst?n={count}", timeout=300
            )
            plain.append(burst_rate(client))
        f, p = percentile(delivered, 50), percentile(plain, 50)
        self.report.add(
            Row(
                f"throughput to one client, {count:,} chunks (median of {len(delivered)})",
                rate(f),
                rate(p),
                ratio(f, p),
                "≥ 0.5x baseline",
                verdict(f >= 0.5 * p),
            )
        )
        s = percentile(stored, 50)
        self.report.add(
            Row(
                "events stored in Redis per second, same burst (info)",
                rate(s),
                f"{xadd_rps:,.0f} XADD/s" if xadd_rps else "—",
                ratio(s, xadd_rps) if xadd_rps else "—",
            )
        )

    async def replay(self) -> None:
        events = 10_000
        # execution:started, block:started, block:completed and execution:completed
        # around the chunks: 10,000 events in all, every one retained.
        execution_id = await self.start("bench-burst", {"text": words(events - 4)})
        snapshot = await self.wait_status(execution_id, {"completed", "failed"}, timeout=120)
        if snapshot["lastEventId"] != events or snapshot["firstRetainedEventId"] != 1:
            self.report.notes.append(f"replay: unexpected execution shape {snapshot}")
        path = f"/api/executions/{execution_id}/stream"
        flowcast: list[float] = []
        plain: list[float] = []
        for _ in range(self.config.replay_runs):
            client, started = await self.stream(
                self.stack.b.port, "GET", path, headers={"Last-Event-ID": "0"}
            )
            assert client.last_frame_at is not None
            if client.frames != events:
                self.report.notes.append(f"replay: got {client.frames} frames, not {events}")
            flowcast.append(client.last_frame_at - started)
            client, started = await self.stream(
                self.stack.baseline.port, "GET", f"/burst?n={events - 1}"
            )
            assert client.last_frame_at is not None
            plain.append(client.last_frame_at - started)
        for pct in (50, 99):
            f, p = percentile(flowcast, pct), percentile(plain, pct)
            self.report.add(
                Row(
                    f"replay 10,000 events p{pct} ({len(flowcast)} runs)",
                    ms(f),
                    ms(p),
                    ratio(f, p),
                    "< 150 ms" if pct == 50 else "—",
                    verdict(f < 0.150) if pct == 50 else "—",
                )
            )

    async def fanout(self) -> None:
        n, count, tps = (
            self.config.fanout_clients,
            self.config.fanout_events,
            self.config.fanout_rate,
        )
        execution_id = await self.start("bench-fanout", {"text": words(count)})
        await self.wait_status(execution_id, {"paused"}, timeout=30)
        flowcast = await self.fan(
            self.stack.a.port,
            f"/api/executions/{execution_id}/stream",
            "execution:paused",
            self.resume(execution_id),
            timeout=count / tps + 120,
        )
        name = f"/fanout/{secrets.token_hex(4)}"
        plain = await self.fan(
            self.stack.baseline.port,
            name,
            "hello",
            self.http.post(f"{self.stack.baseline.url}{name}/start?n={count}&rate={tps}"),
            timeout=count / tps + 120,
        )
        for (lat, cpu, complete, spreads), name in ((flowcast, "Flowcast"), (plain, "baseline")):
            self.report.notes.append(
                f"fan-out ({name}): one event reached its first and its last client "
                f"{ms(percentile(spreads, 50))} apart at the median, {ms(max(spreads))} at worst."
            )
            if len(lat) != n * count or complete != n:
                self.report.notes.append(
                    f"fan-out ({name}): {len(lat):,} of {n * count:,} chunk deliveries, "
                    f"{complete} of {n} clients saw the end."
                )
            self.report.notes.append(
                f"fan-out ({name}): the client process was busy {cpu:.0%} of the wall time "
                "(near 100% would mean the client, not the server, is the limit)."
            )
        for pct in (50, 99):
            f, p = percentile(flowcast[0], pct), percentile(plain[0], pct)
            self.report.add(
                Row(
                    f"fan-out p{pct}, {n:,} clients, {count} chunks at {tps:g}/s",
                    ms(f),
                    ms(p),
                    ratio(f, p),
                    "< 250 ms" if pct == 99 else "—",
                    verdict(f < 0.250) if pct == 99 else "—",
                )
            )

    async def recovery(self) -> None:
        await Recovery(self.stack, self.config, self.report, self.http).run()

    async def starts(self) -> None:
        scale = Scale(self.stack, self.config, self.report)
        try:
            await scale.starts()
        finally:
            await scale.close()

    async def starts_cost(self) -> None:
        await StartsCost(self.stack, self.config, self.report).run()

    async def streams(self) -> None:
        scale = Scale(self.stack, self.config, self.report)
        try:
            await scale.streams()
        finally:
            await scale.close()

    async def queue(self) -> None:
        await QueueBench(self.stack, self.config, self.report).run()

    async def floor(self) -> None:
        await Floor(self).run()

    async def resume(self, execution_id: str) -> httpx.Response:
        response = await self.http.post(
            f"/api/executions/{execution_id}/resume", json={"input": {}}
        )
        response.raise_for_status()
        return response

    async def fan(
        self,
        port: int,
        path: str,
        attached_event: str,
        go: Awaitable[Any],
        *,
        timeout: float,
    ) -> tuple[list[float], float, int, list[float]]:
        """Attach N clients, wait until each got ``attached_event``, start, read to the end.

        Returns every chunk's latency on every client, the client process's CPU share
        while the events flowed, and how many clients saw the terminal event.
        """
        recorders = [LatencyRecorder() for _ in range(self.config.fanout_clients)]
        request = http_request("GET", path, port=port, headers={**SSE, "Last-Event-ID": "0"})
        clients: list[SSEClient] = []
        for start in range(0, len(recorders), 50):
            clients += await asyncio.gather(
                *(open_stream(port, request, r) for r in recorders[start : start + 50])
            )
        async with asyncio.timeout(60):
            while not all(attached_event in r.types for r in recorders):
                await asyncio.sleep(0.05)
        cpu_before = _cpu_seconds()
        wall_before = time.perf_counter()
        await go
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(client.done for client in clients))
        busy = (_cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before)
        latencies = [value for r in recorders for value in r.latencies]
        complete = sum(1 for r in recorders if r.types and r.types[-1] == "execution:completed")
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for r in recorders:
            for event_id, at in r.received:
                first[event_id] = min(first.get(event_id, at), at)
                last[event_id] = max(last.get(event_id, at), at)
        spreads = [last[event_id] - first[event_id] for event_id in first] or [0.0]
        return latencies, busy, complete, spreads

    async def memory(self) -> None:
        config = self.config
        budget = config.memory_budget_bytes
        server = FlowcastServer(
            data_dir=self.stack.root / "memory",
            env=self.stack.flowcast_env(
                FLOWCAST_EVENT_BUDGET_BYTES=str(budget), FLOWCAST_REDIS_PREFIX="fcmem"
            ),
        )
        await server.start()
        try:
            started = time.perf_counter()
            await self.http.put(
                f"{server.url}/api/workflows/bench-memory",
                json=next(w for w in workflows(config) if w["id"] == "bench-memory"),
            )
            async with peak_rss(server.pid) as rss:
                execution_id = await self.start("bench-memory", {}, server=server.url)
                snapshot = await self.wait_status(
                    execution_id, {"completed", "failed"}, timeout=480, server=server.url
                )
            elapsed = time.perf_counter() - started
            settled, settled_after = await settle_rss(server.pid, rss.before)
        finally:
            await server.stop()
        async with Redis.from_url(self.stack.valkey.url) as redis:
            used = 0
            keys = 0
            async for key in redis.scan_iter(match=f"fcmem:{{{execution_id}}}:*", count=100):
                used += int(await redis.memory_usage(key, samples=0) or 0)
                keys += 1
            meta = await redis.hgetall(f"fcmem:{{{execution_id}}}:meta")
            entries: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrange(
                f"fcmem:{{{execution_id}}}:events"
            )  # type: ignore[assignment]
        stored = b"".join(value for _, fields in entries for value in fields.values())
        refs, unavailable = stored.count(b'"$ref":"value"'), stored.count(b'"available":false')
        retained = int(meta.get(b"bytes", b"0"))
        output = config.memory_output_bytes
        self.report.notes.append(
            f"memory: {config.memory_blocks} payload blocks of about "
            f"{math.ceil(output / config.memory_blocks):,} bytes ({output / GiB:.2f} GiB of "
            f"block output) with FLOWCAST_EVENT_BUDGET_BYTES={budget}; status "
            f"{snapshot['status']}, {snapshot['lastEventId']} events, {retained:,} bytes "
            f"retained by the buffer's count, {keys} keys, {refs} value refs in the retained "
            f"events ({unavailable} unavailable), run took {elapsed:.1f} s."
        )
        self.report.add(
            Row(
                f"Redis MEMORY USAGE, one execution with {output / GiB:.2f} GiB of output",
                f"{used / MiB:.2f} MiB",
                f"budget {budget / MiB:.2f} MiB",
                ratio(used, budget),
                "≤ budget",
                verdict(used <= budget and snapshot["status"] == "completed"),
            )
        )
        hwm = (
            f"VmHWM (reset before the run) {rss.hwm / MiB:.0f} MiB"
            if rss.hwm is not None
            else "VmHWM could not be reset: samples only"
        )
        self.report.notes.append(
            f"memory: server RSS {rss.before / MiB:.0f} MiB before the execution; during it "
            f"the highest of {rss.samples} VmRSS samples (every 50 ms) "
            f"{rss.sampled / MiB:.0f} MiB, {hwm}."
        )
        back = settled - rss.before
        self.report.add(
            Row(
                f"server RSS after the {output / GiB:.2f} GiB run ends, over its start",
                f"{back / MiB:+.0f} MiB after {settled_after:.1f} s",
                f"before {rss.before / MiB:.0f} MiB",
                ratio(settled, rss.before),
                f"within {SETTLED_BYTES // MiB} MiB in {SETTLE_SECONDS:.0f} s",
                verdict(back <= SETTLED_BYTES),
            )
        )
        self.report.add(
            Row(
                f"server peak RSS growth during the {output / GiB:.2f} GiB run",
                f"{rss.growth / MiB:.0f} MiB",
                f"output {output / MiB:,.0f} MiB",
                ratio(rss.growth, output),
                "< 100 MiB",
                verdict(rss.growth < 100 * MiB and snapshot["status"] == "completed"),
            )
        )


SETTLE_SECONDS = 5.0
SETTLED_BYTES = 32 * MiB


async def settle_rss(pid: int, baseline: int) -> tuple[int, float]:
    """VmRSS once it is back within ``SETTLED_BYTES`` of ``baseline`` (or after
    ``SETTLE_SECONDS``), and how long after the run's end that was."""
    began = time.perf_counter()
    while True:
        now = status_bytes(pid, "VmRSS")
        waited = time.perf_counter() - began
        if now - baseline <= SETTLED_BYTES or waited >= SETTLE_SECONDS:
            return now, waited
        await asyncio.sleep(0.05)


def burst_rate(client: SSEClient) -> float:
    assert client.first_frame_at is not None and client.last_frame_at is not None
    return (client.frames - 1) / max(client.last_frame_at - client.first_frame_at, 1e-6)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
