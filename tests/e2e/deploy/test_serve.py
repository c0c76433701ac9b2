"""Starting Flowcast: the embedded default and an external Redis."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from app.embedded import free_port
from tests.conftest import SESSION_PREFIX
from tests.support.api import within
from tests.support.ports import own_port
from tests.support.servers import ROOT, FlowcastServer, FlowcastWorker, ValkeyServer, wait_ready
from tests.support.sse import collect

FLOWCAST = Path(sys.executable).with_name("flowcast")


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(90)
async def test_flowcast_serve_with_no_configuration_runs_on_an_embedded_engine(
    tmp_path: Path,
) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    port = own_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    env["FLOWCAST_PORT"] = str(port)  # only so parallel runs do not collide on 8000
    flowcast = Path(sys.executable).with_name("flowcast")
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        # Its own process group, as a shell gives a foreground job: Ctrl-C goes to it all.
        process = subprocess.Popen(
            [str(flowcast), "serve"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url, process, log_path, timeout=60)
        data_dir = tmp_path / ".flowcast"
        assert (data_dir / "valkey").is_dir()
        assert (data_dir / "values").is_dir()
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            listed = (await client.get("/api/workflows")).json()["workflows"]
            assert {"parallel-report", "stream-story", "route-ticket"} <= {w["id"] for w in listed}
            response, frames = await collect(
                client,
                "/api/workflows/route-ticket/execute",
                method="POST",
                json={"input": {"priority": "high", "subject": "disk full"}},
            )
            assert response.status_code == 200
            types = [(f.json["type"], f.json["data"].get("blockId")) for f in frames]
            assert ("block:skipped", "queue") in types
            assert types[-1] == ("execution:completed", None)
        engine_port = _engine_port(data_dir / "valkey")
        assert _port_open(engine_port)
        log_text = log_path.read_text()
        assert "loopback only" in log_text
        # Not a terminal: JSON lines, and they say where workflows and data come from.
        entries = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
        loaded = next(e for e in entries if e["message"].startswith("workflows loaded"))
        assert loaded["dir"] == str(tmp_path / "examples") and loaded["count"] >= 3
        data = next(e for e in entries if e["message"].startswith("data directory"))
        assert data["dir"] == str(data_dir)
        shutdown_from = len(log_path.read_text().splitlines())
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C at a terminal
        process.wait(timeout=30)
    assert not _port_open(port)
    assert not _port_open(engine_port), "the embedded engine outlived the server"
    # The engine was not interrupted before the server: a clean shutdown warns of nothing.
    shutdown = [json.loads(line) for line in log_path.read_text().splitlines()[shutdown_from:]]
    assert [e["message"] for e in shutdown if e["level"] in ("warning", "error", "critical")] == []


def _engine_port(valkey_dir: Path) -> int:
    # The engine writes its port into its log line "Ready to accept connections tcp".
    for line in (valkey_dir / "valkey.log").read_text().splitlines():
        if "Running mode=" in line and "port=" in line:
            return int(line.split("port=")[1].split(".")[0].split()[0])
    raise AssertionError("no port in the engine's log")


def test_serve_refuses_a_public_address_without_api_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    flowcast = Path(sys.executable).with_name("flowcast")
    result = subprocess.run(
        [str(flowcast), "serve", "--host", "0.0.0.0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "FLOWCAST_API_KEYS" in result.stderr


async def test_factory_with_redis_url_uses_that_server(
    client: httpx.AsyncClient, redis: Redis, unique: str, server: FlowcastServer
) -> None:
    workflow = {
        "id": f"ext-{unique}",
        "blocks": [{"id": "a", "type": "transform", "config": {"value": 1}}],
    }
    assert (await client.put(f"/api/workflows/ext-{unique}", json=workflow)).status_code == 201
    assert await redis.hexists(f"{SESSION_PREFIX}:workflows:default", f"ext-{unique}")
    started = (await client.post(f"/api/workflows/ext-{unique}/execute", json={})).json()
    _, frames = await collect(client, started["streamUrl"])
    assert frames[-1].event == "execution:completed"
    stored = await redis.xrange(f"{SESSION_PREFIX}:{{{started['executionId']}}}:events")
    assert [int(entry_id.split(b"-")[0]) for entry_id, _ in stored] == [int(f.id) for f in frames]
    assert not (server.data_dir / "valkey").exists()


class _Terminal:
    """What a process wrote to the pseudo-terminal it has as stdout and stderr."""

    def __init__(self) -> None:
        self.main, self.child = pty.openpty()
        self._written = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.main, 65536)  # EIO once every writer is gone
            except OSError:
                return
            if not chunk:
                return
            self._written += chunk

    @property
    def text(self) -> str:
        return bytes(self._written).decode().replace("\r\n", "\n")

    def close(self) -> None:
        self._reader.join(10)
        os.close(self.main)


@contextmanager
def _serve_on_a_terminal(cwd: Path, env: dict[str, str]) -> Iterator[tuple[str, _Terminal]]:
    """``flowcast serve`` with a terminal as stdout and stderr; its URL and that terminal."""
    port = own_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    terminal = _Terminal()
    process = subprocess.Popen(
        [str(FLOWCAST), "serve"],
        cwd=cwd,
        env={**base, "FLOWCAST_PORT": str(port), **env},
        stdin=subprocess.DEVNULL,
        stdout=terminal.child,
        stderr=terminal.child,
    )
    os.close(terminal.child)
    try:
        yield f"http://127.0.0.1:{port}", terminal
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        terminal.close()


async def _ready(url: str, terminal: _Terminal, timeout: float = 30) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:

        async def ready() -> bool:
            try:
                return (await client.get("/readyz")).status_code == 200
            except httpx.TransportError:
                return False

        if not await within(ready, timeout, every=0.05):
            raise AssertionError(f"not ready:\n{terminal.text}")


TIME_LEVEL = r"\d\d:\d\d:\d\d\.\d{3} (?:INFO   |WARNING|ERROR  ) "


async def test_serve_on_a_terminal_logs_readable_lines_and_warns_of_no_workflows(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    env = {"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": uuid.uuid4().hex[:8]}
    with _serve_on_a_terminal(tmp_path, env) as (url, terminal):
        await _ready(url, terminal)
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            assert (await client.get("/api/workflows")).json() == {"workflows": []}
            await client.get("/api/executions/ex_none/stream", params={"token": "a.b"})
    lines = terminal.text.splitlines()
    shown = terminal.text
    assert not [line for line in lines if line.startswith("{")], f"no JSON here:\n{shown}"
    assert re.search(
        rf"^{TIME_LEVEL}flowcast: data directory \(FLOWCAST_DATA_DIR\)  "
        rf"dir={re.escape(str(tmp_path / '.flowcast'))}$",
        shown,
        re.MULTILINE,
    ), shown
    assert re.search(
        rf"^{TIME_LEVEL}flowcast: no workflows loaded: FLOWCAST_WORKFLOWS_DIR is not set .*"
        rf"  count=0 dir={re.escape(str(tmp_path / 'examples'))}$",
        shown,
        re.MULTILINE,
    ), shown
    assert re.search(rf"^{TIME_LEVEL}uvicorn: Application startup complete\.$", shown, re.M)
    assert re.search(rf"^{TIME_LEVEL}uvicorn\.access: GET /api/workflows 200$", shown, re.M)
    assert re.search(
        rf"^{TIME_LEVEL}uvicorn\.access: GET /api/executions/ex_none/stream"
        rf"\?token=\[redacted\] 404$",
        shown,
        re.M,
    ), shown


async def test_serve_on_a_terminal_logs_json_when_asked(
    tmp_path: Path, valkey: ValkeyServer
) -> None:
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": uuid.uuid4().hex[:8],
        "FLOWCAST_LOG_FORMAT": "json",
        "FLOWCAST_WORKFLOWS_DIR": str(ROOT / "examples"),
    }
    with _serve_on_a_terminal(tmp_path, env) as (url, terminal):
        await _ready(url, terminal)
    lines = [line for line in terminal.text.splitlines() if line.strip()]
    logged = [line for line in lines if not line.startswith("flowcast: ")]  # serve's own
    entries = [json.loads(line) for line in logged]
    loaded = next(
        e for e in entries if e["message"] == "workflows loaded from FLOWCAST_WORKFLOWS_DIR"
    )
    assert loaded["dir"] == str(ROOT / "examples") and loaded["count"] >= 3


def test_a_workflows_dir_that_was_set_but_does_not_exist_stops_the_start(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    env = {**base, "FLOWCAST_WORKFLOWS_DIR": "exmaples", "FLOWCAST_PORT": str(free_port())}
    served = subprocess.run(
        [str(FLOWCAST), "serve"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert served.returncode == 2
    assert served.stderr == (
        f"flowcast: FLOWCAST_WORKFLOWS_DIR=exmaples names no directory (resolved against "
        f"the working directory: {tmp_path / 'exmaples'})\n"
    )
    factory = subprocess.run(
        [sys.executable, "-m", "uvicorn", "--factory", "app.main:create_app"],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert factory.returncode != 0
    assert "FLOWCAST_WORKFLOWS_DIR=exmaples names no directory" in factory.stderr


@pytest.mark.parametrize("kind", [FlowcastServer, FlowcastWorker])
async def test_a_port_in_use_stops_the_start_with_its_reason_and_a_first_start_moves_on(
    valkey: ValkeyServer, tmp_path: Path, kind: type[FlowcastServer]
) -> None:
    """uvicorn binds its port once the startup is over: a port taken meanwhile (by any
    other process's connection, on a busy machine) ends that process with "address
    already in use" in its log (``flowcast worker``, bound before its startup: "port N
    on 127.0.0.1 is already in use"). The tests' servers then start once more on another
    free port, which nothing knew yet (tests/support/servers.py)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = kind(
            data_dir=tmp_path / "moved",
            env={
                "FLOWCAST_REDIS_URL": valkey.url,
                "FLOWCAST_REDIS_PREFIX": f"m{uuid.uuid4().hex[:6]}",
            },
        )
        first_log = server.log_path = tmp_path / "moved" / "taken.log"
        server.port = taken.getsockname()[1]
        try:
            await server.start()
            assert server.port != taken.getsockname()[1]
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                assert (await client.get("/readyz")).status_code == 200
        finally:
            await server.stop()
    assert "already in use" in first_log.read_text()
