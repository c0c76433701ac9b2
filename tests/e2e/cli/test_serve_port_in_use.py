"""``flowcast serve`` and ``flowcast worker`` on a port already taken.

Issue 26 (step 18): the server started completely (the engine, the runner), then exited
3 with an ``Errno 98`` traceback. The port is now bound before anything starts, and a
taken one is said in one line that names the way to pick another.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

FLOWCAST = Path(sys.executable).with_name("flowcast")


def run_cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    return subprocess.run(
        [str(FLOWCAST), *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.timeout(90)
def test_a_port_in_use_is_said_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        said = (
            f"flowcast: port {port} on 127.0.0.1 is already in use; "
            "pick another port with --port N or FLOWCAST_PORT=N\n"
        )
        for args, env in [
            (("serve",), {"FLOWCAST_PORT": port}),
            (("serve", "--port", port), {}),
            (("worker", "--port", port), {}),
            # A Redis that is not there: reaching for it would fail (or wait) instead.
            (("serve",), {"FLOWCAST_PORT": port, "FLOWCAST_REDIS_URL": "redis://127.0.0.1:9"}),
        ]:
            result = run_cli(*args, cwd=tmp_path, FLOWCAST_DATA_DIR=str(data_dir), **env)
            assert (result.returncode, result.stderr, result.stdout) == (2, said, ""), args
    # Nothing started: the embedded engine would have made its data directory.
    assert not data_dir.exists()


@pytest.mark.timeout(60)
def test_an_address_that_cannot_be_listened_on_is_said_in_one_line(tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface of this machine; with keys set the
    # loopback-only rule lets it through to the bind.
    key = "port-key-" + "p" * 24
    result = run_cli("serve", "--host", "192.0.2.1", cwd=tmp_path, FLOWCAST_API_KEYS=key)
    assert result.returncode == 2
    assert result.stderr == (
        "flowcast: cannot listen on 192.0.2.1: it is no address of this machine; "
        "set --host or FLOWCAST_HOST\n"
    )
    assert not (tmp_path / ".flowcast").exists()
