"""The processes of one run and the workflows it registers."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.embedded import EmbeddedValkey
from tests.support.s3 import CREDENTIALS, MotoServer
from tests.support.servers import FlowcastServer

BUCKET = "flowcast-bench"
MiB = 1024 * 1024
GiB = 1024 * MiB
SSE = {"Accept": "text/event-stream"}


@dataclass(frozen=True)
class Config:
    """Sizes of one run; ``QUICK`` shrinks the counts, never the definitions' rates."""

    ttfe_runs: int = 200
    sl_events: int = 1_500
    so_runs: int = 5
    burst_events: int = 100_000
    burst_runs: int = 3
    replay_runs: int = 20
    fanout_clients: int = 1_000
    fanout_events: int = 200
    fanout_rate: float = 20.0
    memory_blocks: int = 499  # plus one sink: a workflow has at most 500 blocks
    memory_output_bytes: int = GiB
    memory_budget_bytes: int = 4 * MiB
    xadd_requests: int = 200_000
    recovery_runs: int = 3  # of each: SIGKILL, then SIGTERM
    recovery_blocks: int = 20  # a chain of `delay` blocks (longer than the grace)...
    recovery_block_ms: int = 500  # ...of this length each
    recovery_signal_at: int = 4  # the signal once this block's block:started is seen
    recovery_lease_seconds: float = 2.0
    recovery_grace_seconds: float = 5.0
    starts_clients: tuple[int, int] = (64, 256)  # concurrent loops: the base, then more
    starts_seconds: float = 10.0  # the measured window of each case...
    starts_warmup: float = 2.0  # ...after this much of the same load
    starts_workers: int = 1  # client processes
    starts_cost_count: int = 5_000  # executions (and bare requests) per cost round...
    starts_cost_rounds: int = 2  # ...alternating; the accept windows are starts_seconds
    starts_cost_sample: int = 200  # starts watched with MONITOR on
    streams_executions: int = 1_000  # running, 1 event/s each
    streams_open: int = 5_000  # SSE clients opened at once...
    streams_total: int = 10_000  # ...then grown to this many
    streams_window: float = 10.0  # delivery latency measured for this long, each size...
    streams_settle: float = 5.0  # ...this long after the opens
    streams_workers: int = 4  # client processes holding the streams
    queue_slots: int = 16  # FLOWCAST_WORKER_SLOTS of each of the two workers
    queue_start_runs: int = 200  # accepted → started with free slots, each way
    queue_flood: int = 10_000  # the heavy tenant's queued executions...
    queue_spread: int = 20  # ...over this many workflows...
    queue_block_ms: int = 500  # ...each holding a slot this long
    queue_light_runs: int = 200  # the light tenant's starts meanwhile
    queue_share_seconds: float = 60.0  # both tenants backlogged this long
    queue_kill_running: int = 16  # running on the worker that is SIGKILLed...
    queue_kill_runs: int = 3  # ...this many times
    queue_chain_blocks: int = 20  # `delay` blocks (recovery_block_ms) of each of them
    queue_lease_seconds: float = 15.0  # FLOWCAST_LEASE_SECONDS of the start, light, share
    queue_start_timeout: float = 5.0  # a start with no execution:started by then is stuck
    floor_rounds: int = 3  # the floor's SL cases alternate in this many rounds of sl_events


FULL = Config()
QUICK = Config(
    ttfe_runs=50,
    sl_events=300,
    so_runs=2,
    burst_events=100_000,
    burst_runs=1,
    replay_runs=5,
    fanout_events=60,
    memory_blocks=50,
    memory_output_bytes=100 * MiB,
    xadd_requests=50_000,
    recovery_runs=1,
    starts_seconds=4.0,
    starts_warmup=1.0,
    starts_cost_count=2_000,
    starts_cost_rounds=1,
    streams_executions=200,
    streams_open=1_000,
    streams_total=2_000,
    streams_window=4.0,
    streams_settle=2.0,
    streams_workers=2,
    queue_start_runs=50,
    queue_light_runs=50,
    queue_share_seconds=15.0,
    queue_kill_runs=1,
    floor_rounds=1,
)

# Registered on the servers their metric starts, not on A.
OWN_SERVER = frozenset({"bench-memory", "bench-recovery", "bench-starts", "bench-streams"})


# --- processes ---------------------------------------------------------------------


class BaselineServer(FlowcastServer):
    """The plain sse-starlette app under uvicorn, in its own process."""

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "uvicorn", "--factory", "bench.baseline_sse:create_app",
            "--host", "127.0.0.1", "--port", str(self.port), "--no-access-log",
        ]  # fmt: skip


class RelayServer(FlowcastServer):
    """``bench/relay_sse.py`` under uvicorn, in its own process (on ``FLOWCAST_REDIS_URL``)."""

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "uvicorn", "--factory", "bench.relay_sse:create_app",
            "--host", "127.0.0.1", "--port", str(self.port), "--no-access-log",
        ]  # fmt: skip


class Stack:
    """Every process of one run; stopped in reverse order of starting."""

    def __init__(self, root: Path, config: Config) -> None:
        self.root = root
        self.config = config
        self.valkey = EmbeddedValkey(data_dir=root / "valkey")
        self.moto = MotoServer(log_path=root / "moto.log")
        self.a: FlowcastServer
        self.b: FlowcastServer
        self.baseline = BaselineServer(data_dir=root / "baseline")

    def flowcast_env(self, **extra: str) -> dict[str, str]:
        return {
            **CREDENTIALS,
            "FLOWCAST_REDIS_URL": self.valkey.url,
            "FLOWCAST_S3_BUCKET": BUCKET,
            "FLOWCAST_S3_ENDPOINT_URL": self.moto.url,
            "FLOWCAST_MAX_EXECUTIONS_PER_TENANT": "0",
            **extra,
        }

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Stack]:
        async with contextlib.AsyncExitStack() as stack:
            await self.valkey.start()
            stack.push_async_callback(self.valkey.stop)
            await self.moto.start()
            stack.push_async_callback(self.moto.stop)
            await asyncio.to_thread(self._create_bucket)
            self.a = FlowcastServer(data_dir=self.root / "a", env=self.flowcast_env())
            self.b = FlowcastServer(data_dir=self.root / "b", env=self.flowcast_env())
            for server in (self.a, self.b, self.baseline):
                stack.push_async_callback(server.stop)
            await asyncio.gather(self.a.start(), self.b.start(), self.baseline.start())
            yield self

    def _create_bucket(self) -> None:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.moto.url,
            region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket=BUCKET)


# --- workflows ---------------------------------------------------------------------


def words(count: int) -> str:
    return " ".join(f"w{index}" for index in range(count))


def generate_block(tps: float) -> dict[str, Any]:
    return {
        "id": "talk",
        "type": "generate",
        "config": {"text": "{{ input.text }}", "tokensPerSecond": tps},
    }


def workflows(config: Config) -> list[dict[str, Any]]:
    payload_bytes = math.ceil(config.memory_output_bytes / config.memory_blocks)
    # One byte more per block: equal payloads would share one content-addressed object
    # in the value store, and the run would upload a single value.
    payloads = [
        {"id": f"p{index:03d}", "type": "payload", "config": {"bytes": payload_bytes + index}}
        for index in range(config.memory_blocks)
    ]
    return [
        {
            "id": "bench-ttfe",
            "blocks": [{"id": "only", "type": "transform", "config": {"value": 1}}],
        },
        {
            "id": "bench-sl",
            "blocks": [
                {"id": "wait", "type": "delay", "config": {"ms": 500}},
                generate_block(100),
            ],
            "edges": [{"from": "wait", "to": "talk"}],
        },
        {"id": "bench-so", "blocks": [generate_block(100)]},
        {"id": "bench-burst", "blocks": [generate_block(0)]},
        {
            "id": "bench-fanout",
            "blocks": [
                {
                    "id": "gate",
                    "type": "approval",
                    "config": {"prompt": "go?", "schema": {"type": "object"}},
                },
                generate_block(config.fanout_rate),
            ],
            "edges": [{"from": "gate", "to": "talk"}],
        },
        {
            "id": "bench-memory",
            "blocks": [
                *payloads,
                {"id": "done", "type": "transform", "config": {"value": "ok"}},
            ],
            "edges": [{"from": block["id"], "to": "done"} for block in payloads],
        },
        {
            "id": "bench-recovery",
            "blocks": [
                {"id": f"d{index:02d}", "type": "delay", "config": {"ms": config.recovery_block_ms}}
                for index in range(config.recovery_blocks)
            ],
            "edges": [
                {"from": f"d{index - 1:02d}", "to": f"d{index:02d}"}
                for index in range(1, config.recovery_blocks)
            ],
        },
        {
            "id": "bench-starts",
            "blocks": [{"id": "only", "type": "transform", "config": {"value": 1}}],
        },
        # 1 chunk per second for as many seconds as the input has words.
        {"id": "bench-streams", "blocks": [generate_block(1)]},
    ]
