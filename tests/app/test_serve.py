"""Starting Flowcast: the embedded default and an external Redis."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from app.embedded import free_port
from tests.conftest import SESSION_PREFIX
from tests.support.servers import ROOT, FlowcastServer, wait_ready
from tests.support.sse import collect


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(90)
async def test_flowcast_serve_with_no_configuration_runs_on_an_embedded_engine(
    tmp_path: Path,
) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    env["FLOWCAST_PORT"] = str(port)  # only so parallel runs do not collide on 8000
    flowcast = Path(sys.executable).with_name("flowcast")
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(flowcast), "serve"], cwd=tmp_path, env=env, stdout=log, stderr=log
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
        assert "loopback only" in log_path.read_text()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert not _port_open(port)
    assert not _port_open(engine_port), "the embedded engine outlived the server"


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
