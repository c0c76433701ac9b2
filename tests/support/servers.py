"""Real processes for tests: a Valkey server and Flowcast under uvicorn, on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from app.embedded import EmbeddedValkey
from tests.support.ports import own_port
from tests.support.zygote import Process, spawn

ROOT = Path(__file__).resolve().parents[2]
# How long a test server keeps an idle keep-alive connection: well past the 5 s after
# which an httpx client stops reusing one (FlowcastServer.command says why).
KEEP_ALIVE_SECONDS = 30


class ValkeyServer(EmbeddedValkey):
    """A Valkey server the tests can stop, kill and start again on the same port.

    ``durable``: every write is in its AOF before it is answered (``appendfsync
    always``). With the default ``everysec``, Valkey may answer writes whose AOF write
    it postponed while a slow fsync runs (up to 2 s, on a busy disk): a SIGKILL then
    loses writes it acknowledged, a store come back behind. A test that kills Valkey to
    cut the store off, and expects nothing it acknowledged to be lost, asks for this.
    """

    def __init__(self, *, durable: bool = False, port: int | None = None, **options: Any) -> None:
        # A port of this worker's own (tests/support/ports.py): while the server is down
        # to be started again on it, no other process can be given it.
        super().__init__(port=port or own_port(), **options)
        self.durable = durable

    def command(self) -> list[str]:
        return [*super().command(), *(["--appendfsync", "always"] if self.durable else [])]

    @property
    def pid(self) -> int:
        """The running server's process id (to stall it with SIGSTOP)."""
        assert self._process is not None, "the server is not running"
        return self._process.pid

    def kill(self) -> None:
        process = self._process
        if process is not None:
            process.kill()
            process.wait()
            if process.stderr is not None:
                process.stderr.close()
            self._process = None


PORT_TRIES = 3


class FlowcastServer:
    """``uvicorn --factory app.main:create_app`` in a subprocess on a free loopback port
    of this worker's own (tests/support/ports.py: no other process can take it before
    the server binds it, or while it is down to be started again on it)."""

    def __init__(
        self, *, data_dir: Path, env: dict[str, str] | None = None, access_log: bool = False
    ) -> None:
        self.access_log = access_log
        self.data_dir = data_dir
        self.port = own_port()
        self.env = env or {}
        self.log_path = data_dir / f"server-{self.port}.log"
        self._process: Process | None = None
        self._started = False  # its port was bound once: a restart keeps it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The running process's id (to stop or continue it with a signal)."""
        assert self._process is not None, "the server is not running"
        return self._process.pid

    def command(self) -> list[str]:
        # The server keeps an idle connection longer than a test's client reuses one
        # (httpx: 5 s, KEEP_ALIVE_SECONDS here). With both at 5 s, a request sent on a
        # connection idle for almost 5 s races the server's close; on a busy machine the
        # client reads a response late, so its 5 s end after the server's, and the
        # server closed connections the client had just sent a request on (httpx
        # ReadError: a 64-PUT round of test_tenant_isolation, beside a busy loop). A
        # client would have to read a response 25 s late for this to happen again.
        return [
            sys.executable, "-m", "uvicorn", "--factory", "app.main:create_app",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--timeout-keep-alive", str(KEEP_ALIVE_SECONDS),
            *([] if self.access_log else ["--no-access-log"]),
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
        return {
            **base,
            "FLOWCAST_DATA_DIR": str(self.data_dir),
            "FLOWCAST_WORKFLOWS_DIR": str(ROOT / "examples"),
            **self.env,
        }

    async def start(self, timeout: float = 30.0) -> None:
        """Start the process and wait until it is ready. Its port is bound only once
        the process's startup is over; should another program bind it meanwhile
        (tests/support/ports.py keeps the kernel and the other test processes off it,
        not every program), a first start moves to another port (nothing knew this one
        yet); a restart keeps its port."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(PORT_TRIES):
            self._process = await asyncio.to_thread(
                spawn, self.command(), cwd=ROOT, env=self.environment(), log_path=self.log_path
            )
            try:
                await wait_ready(self.url, self._process, self.log_path, timeout)
            except ServerExited as exited:
                # uvicorn's "[Errno 98] ... address already in use"; ``flowcast worker``
                # (app/cli.py, bound before its startup): "port N on H is already in use".
                taken = "already in use" in exited.log
                if self._started or not taken or attempt == PORT_TRIES - 1:
                    raise
                self.port = own_port()
                self.log_path = self.data_dir / f"server-{self.port}.log"
                continue
            self._started = True
            return

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        process, self._process = self._process, None
        if process is None:
            return 0
        if process.poll() is None:
            process.send_signal(sig)
        try:
            return await asyncio.to_thread(process.wait, timeout)
        except subprocess.TimeoutExpired:
            # Where it is stuck (app/main.py: SIGUSR1 writes every thread's stack), then
            # gone: the failure says why, and nothing is left running.
            process.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1)
            process.send_signal(signal.SIGKILL)
            tail = "\n".join(self.logs().splitlines()[-80:])
            raise AssertionError(
                f"the server on port {self.port} did not stop within {timeout:g} s after "
                f"signal {sig}; the end of its log:\n{tail}"
            ) from None

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


class FlowcastWorker(FlowcastServer):
    """``flowcast worker`` (the command line itself, a fresh process) on a free loopback
    port: a process that only runs work, with its health and metrics routes."""

    def command(self) -> list[str]:
        return [str(Path(sys.executable).with_name("flowcast")), "worker"]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "FLOWCAST_PORT": str(self.port)}


class ServerExited(RuntimeError):
    """The server's process exited before it was ready."""

    def __init__(self, code: int | None, log: str) -> None:
        super().__init__(f"server exited with {code}:\n{log}")
        self.log = log


async def wait_ready(url: str, process: Process, log_path: Path, timeout: float) -> None:
    """Poll ``/readyz`` until it answers 200; fail early if the process exits."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:
        while True:
            if process.poll() is not None:
                raise ServerExited(process.returncode, log_path.read_text())
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"server not ready after {timeout}s:\n{log_path.read_text()}")
            await asyncio.sleep(0.05)


# Two tenants' API keys, for servers started with FLOWCAST_API_KEYS naming them.
ALPHA, BETA = "alpha-key-" + "a" * 20, "beta-key-" + "b" * 20


def prefix() -> str:
    """A Redis prefix of a test's own."""
    return f"own{uuid.uuid4().hex[:6]}"


async def started_server(tmp_path: Path, name: str, **env: str) -> FlowcastServer:
    """A Flowcast server under ``tmp_path / name``, started (``ACCESS_LOG="1"`` in ``env``
    turns its access log on)."""
    access_log = env.pop("ACCESS_LOG", "") == "1"
    server = FlowcastServer(data_dir=tmp_path / name, env=env, access_log=access_log)
    await server.start()
    return server


def bearer(key: str) -> dict[str, str]:
    """The header that presents ``key`` as the caller's API key."""
    return {"Authorization": f"Bearer {key}"}


def authed(server: FlowcastServer, key: str | None = None) -> httpx.AsyncClient:
    """A client of ``server``, with ``key`` as its bearer token when given."""
    return httpx.AsyncClient(base_url=server.url, headers=bearer(key) if key else {}, timeout=30)


def env_on(valkey: ValkeyServer, **settings: str) -> dict[str, str]:
    """The environment of a server on ``valkey``, on a Redis prefix of its own unless
    ``redis_prefix`` names one; ``settings`` are named without ``FLOWCAST_``
    (``lease_seconds="3"``)."""
    return {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": prefix(),
        **{f"FLOWCAST_{name.upper()}": value for name, value in settings.items()},
    }


async def flowcast_on(valkey: ValkeyServer, root: Path, **settings: str) -> FlowcastServer:
    """A Flowcast server on ``valkey`` under ``root``, started (settings as ``env_on``)."""
    server = FlowcastServer(data_dir=root, env=env_on(valkey, **settings))
    await server.start()
    return server


@contextlib.asynccontextmanager
async def serving(
    valkey: ValkeyServer, root: Path, **settings: str
) -> AsyncIterator[FlowcastServer]:
    """``flowcast_on``, stopped when the block ends (a module fixture's whole body)."""
    server = await flowcast_on(valkey, root, **settings)
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def serving_pair(
    valkey: ValkeyServer, root: Path, **settings: str
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    """Replicas A and B on ``valkey`` under ``root/a`` and ``root/b``, sharing one Redis
    prefix of their own (settings as ``env_on``), stopped when the block ends."""
    env = env_on(valkey, **settings)
    servers = (
        FlowcastServer(data_dir=root / "a", env=env),
        FlowcastServer(data_dir=root / "b", env=env),
    )
    await asyncio.gather(*(server.start() for server in servers))
    try:
        yield servers
    finally:
        await asyncio.gather(*(server.stop() for server in servers))
