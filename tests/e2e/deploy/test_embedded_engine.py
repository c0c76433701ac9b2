"""``flowcast serve`` with its embedded engine in a session of its own: a SIGKILLed
server takes its engine down with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.api import until
from tests.support.ports import own_port
from tests.support.servers import ROOT

# ---------------------------------------------------------------- the embedded engine


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]  # a zombie is dead, only not reaped yet


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


@pytest.mark.timeout(90)
async def test_a_sigkilled_flowcast_serve_takes_its_embedded_engine_down(tmp_path: Path) -> None:
    # The engine now runs in a session of its own (Ctrl-C at the terminal must not reach
    # it first); it must still die with the server it belongs to when that one is
    # killed without a chance to stop it (PR_SET_PDEATHSIG), not hold its port forever.
    """Found by the step 14 review."""
    from tests.support.servers import wait_ready

    port = own_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    env.update(
        FLOWCAST_PORT=str(port),
        FLOWCAST_DATA_DIR=str(tmp_path / "data"),
        FLOWCAST_WORKFLOWS_DIR=str(ROOT / "examples"),
    )
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve"],
            cwd=tmp_path, env=env, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    try:
        await wait_ready(f"http://127.0.0.1:{port}", serve, log_path, timeout=60)
        engines = [child for child in _children(serve.pid) if "valkey" in _cmdline(child)]
        assert len(engines) == 1, engines
        serve.kill()
        serve.wait(timeout=10)

        async def engine_gone() -> bool:
            return not _alive(engines[0])

        await until(engine_gone, "the engine died with its serve", 15, every=0.05)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
