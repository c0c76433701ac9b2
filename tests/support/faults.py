"""Faults on real processes, for regression tests and the fault storm.

Each helper injects one fault into a Valkey server or a Flowcast process started by
``tests.support.servers`` and returns once the fault has taken effect (or, for the
ones that heal, once it is over). Valkey faults:

- ``pause_writes``: ``CLIENT PAUSE <ms> WRITE``: writes and scripts wait, reads go on;
- ``debug_sleep``: ``DEBUG SLEEP``: the whole server stops answering for a while;
- ``crash_and_restart``: kill -9, then start again on the same port from its AOF;
- ``take_snapshot`` + ``crash_and_restore``: kill -9, then start from an older snapshot,
  as after a failover to a lagging replica: every write since the snapshot is lost;
- ``crash_and_wipe``: kill -9, then start empty.

Flowcast faults: ``kill_replica`` (SIGKILL), ``terminate_replica`` (SIGTERM, waits
for the drain), and ``fresh_replica`` (the same configuration on a new port); ``replica``
configures one for fault tests (a 1 s lease, a 1 s grace).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from tests.support.api import until
from tests.support.servers import FlowcastServer, ValkeyServer

AOF_DIR = "appendonlydir"
# A multi-part AOF whose base is an RDB file: how a snapshot becomes the data again
# while the server keeps appendonly on (Valkey ignores a lone dump.rdb when AOF is on).
MANIFEST = (
    "file appendonly.aof.1.base.rdb seq 1 type b\nfile appendonly.aof.1.incr.aof seq 1 type i\n"
)


# Fault tests run replicas with a short lease: a dead owner is noticed within seconds.
LEASE_SECONDS = 1.0


def replica(valkey: ValkeyServer, root: Path, name: str, **env: str) -> FlowcastServer:
    """A Flowcast process on ``valkey`` (not started) with a 1 s lease and grace, and its
    own data directory ``root/name``."""
    return FlowcastServer(
        data_dir=root / name,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_LEASE_SECONDS": str(LEASE_SECONDS),
            "FLOWCAST_SSE_PING_SECONDS": "0.5",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
            **env,
        },
    )


class FaultyValkey(ValkeyServer):
    """A ValkeyServer that also takes DEBUG commands from loopback (for DEBUG SLEEP)."""

    def command(self) -> list[str]:
        return [*super().command(), "--enable-debug-command", "local"]


async def command(valkey: ValkeyServer, *args: Any, timeout: float = 30.0) -> Any:
    """Run one command on a connection of its own and return the reply."""
    connection = Redis.from_url(valkey.url, socket_timeout=timeout)
    try:
        return await connection.execute_command(*args)
    finally:
        await connection.aclose()


async def pause_writes(valkey: ValkeyServer, ms: int) -> None:
    """CLIENT PAUSE <ms> WRITE: for ``ms`` every write command and script waits."""
    await command(valkey, "CLIENT", "PAUSE", ms, "WRITE")


async def debug_sleep(valkey: FaultyValkey, seconds: float) -> None:
    """DEBUG SLEEP: the server answers nobody for ``seconds``; returns when it wakes."""
    await command(valkey, "DEBUG", "SLEEP", seconds, timeout=seconds + 30)


async def take_snapshot(valkey: ValkeyServer, destination: Path) -> Path:
    """SAVE, then copy the RDB file to ``destination``: the data as of this instant."""
    await command(valkey, "SAVE")
    destination.parent.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(shutil.copyfile, valkey.data_dir / "dump.rdb", destination)
    return destination


async def crash_and_restart(valkey: ValkeyServer, *, down_seconds: float = 0.0) -> None:
    """kill -9, stay down ``down_seconds``, start again from the AOF (no acknowledged loss)."""
    valkey.kill()
    await asyncio.sleep(down_seconds)
    await valkey.start()


async def crash_and_restore(
    valkey: ValkeyServer, snapshot: Path, *, down_seconds: float = 0.0
) -> None:
    """kill -9, then start from ``snapshot`` (see ``take_snapshot``): writes since are lost."""
    valkey.kill()
    await asyncio.to_thread(_replace_data, valkey.data_dir, snapshot)
    await asyncio.sleep(down_seconds)
    await valkey.start()


async def crash_and_wipe(valkey: ValkeyServer, *, down_seconds: float = 0.0) -> None:
    """kill -9, then start with no data at all."""
    valkey.kill()
    await asyncio.to_thread(_replace_data, valkey.data_dir, None)
    await asyncio.sleep(down_seconds)
    await valkey.start()


def _replace_data(data_dir: Path, snapshot: Path | None) -> None:
    shutil.rmtree(data_dir / AOF_DIR, ignore_errors=True)
    (data_dir / "dump.rdb").unlink(missing_ok=True)
    if snapshot is None:
        return
    aof = data_dir / AOF_DIR
    aof.mkdir(parents=True)
    shutil.copyfile(snapshot, aof / "appendonly.aof.1.base.rdb")
    (aof / "appendonly.aof.1.incr.aof").write_bytes(b"")
    (aof / "appendonly.aof.manifest").write_text(MANIFEST)


async def kill_replica(server: FlowcastServer) -> None:
    """SIGKILL a Flowcast process and reap it: no drain, no goodbye."""
    await server.stop(signal.SIGKILL)


async def terminate_replica(server: FlowcastServer, *, timeout: float = 60.0) -> int:
    """SIGTERM and wait for the drain and exit (its code); past ``timeout``, SIGKILL."""
    pid = server.pid
    try:
        return await server.stop(signal.SIGTERM, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(pid, signal.SIGKILL)
        raise TimeoutError(f"process {pid} still ran {timeout} s after SIGTERM") from None


async def fresh_replica(server: FlowcastServer) -> FlowcastServer:
    """Start a process with ``server``'s configuration and data directory on a new port."""
    replacement = FlowcastServer(data_dir=server.data_dir, env=server.env)
    replacement.access_log = server.access_log
    await replacement.start()
    return replacement


async def wait_store_settled(valkey: ValkeyServer, *, timeout: float, flush: bool = False) -> None:
    """Wait until the store's settling period after a new server is over (claims answer
    503 until then, by design: see lib/execution/store.py); with ``flush``, empty it first."""
    redis = Redis.from_url(valkey.url)
    try:
        if flush:
            await redis.flushall()

        async def settled() -> bool:
            settle_until = await redis.hget("fc:store", "settleUntil")
            seconds, micros = await redis.time()
            return settle_until is None or int(settle_until) <= seconds * 1000 + micros // 1000

        await until(settled, "the store's settle over", timeout, every=0.1)
    finally:
        await redis.aclose()


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP), as /proc shows it."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"
