"""Flowcast processes forked from one that has imported the app already.

A fresh ``python -m uvicorn`` spends most of its start (about 0.7 s of CPU, seconds on
a busy machine) importing FastAPI, redis, httpx and the app, and the suite starts a few
hundred of them. The zygote, a process of its own started on first use, imports all of
that once; each server is then a fork of it that runs the very command line it was
given (``uvicorn.main`` with the same arguments) with its own environment, working
directory, log file and open-file limit. It is a real process on a loopback port that
tests signal, stall and kill as before; as the zygote's child (not the test's), its
exit status comes back through a pipe, with ``subprocess``'s convention (-N: killed by
signal N).

What a forked server cannot tell apart from a fresh interpreter: nothing the app reads
(settings, plugins and clients are all built after the fork, in ``create_app`` and its
lifespan), except that every server shares the zygote's string-hash seed
(``PYTHONHASHSEED`` is fixed when an interpreter starts).

Under pytest (tests/conftest.py) it is on unless ``TESTS_FRESH_PROCESSES=1``; the
benchmarks and ``python -m stress.run`` start fresh interpreters.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

STATUS = struct.Struct("i")
MESSAGE_BYTES = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
PRELOADED = (  # what every server imports
    "app.main",
    "uvicorn.main",
    "uvicorn.server",
    "uvicorn.loops.auto",
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.websockets.auto",
)


class Process(Protocol):
    """What the tests use of a server process: ``subprocess.Popen``'s names."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


# -- the test process's side ---------------------------------------------------------


class Forked:
    """A server forked by the zygote, driven like a ``subprocess.Popen``."""

    def __init__(self, args: list[str], pid: int, status_fd: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        # Kept open until this object goes: a wait in a thread and a poll in the loop
        # may both be looking at it.
        self._status_fd = status_fd
        self._lock = threading.Lock()

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._status_fd)

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._status_fd], [], [], timeout)
            if not ready:
                return None
            with self._lock:
                if self.returncode is None:
                    data = os.read(self._status_fd, STATUS.size)
                    # No status at all: the zygote died, and its children with it.
                    self.returncode = STATUS.unpack(data)[0] if data else -signal.SIGTERM
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The process servers are forked from: one per test session, started at once (from
    the main thread, so that its PDEATHSIG follows the test process) and importing while
    the tests are collected."""

    def __init__(self) -> None:
        from app.embedded import die_with_parent

        self._lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="flowcast-zygote-"))
        self.log_path = self._dir / "zygote.log"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.zygote", str(theirs.fileno())],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(theirs.fileno(),),
                preexec_fn=die_with_parent,
            )
        theirs.close()
        self._socket: socket.socket | None = ours

    def spawn(self, args: list[str], *, cwd: Path, env: dict[str, str], log_path: Path) -> Forked:
        """Fork a server that runs ``uvicorn`` with ``args`` (what follows ``-m uvicorn``)."""
        request = {
            "args": args,
            "cwd": str(cwd),
            "env": env,
            "log": str(log_path),
            "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        }
        with self._lock:
            if self._socket is None:
                raise RuntimeError("the zygote is closed")
            read_end, write_end = os.pipe()
            try:
                socket.send_fds(self._socket, [json.dumps(request).encode()], [write_end])
                reply = self._socket.recv(MESSAGE_BYTES)
            except OSError:
                reply = b""
            finally:
                os.close(write_end)
            if not reply:
                os.close(read_end)
                raise RuntimeError(f"the zygote is gone:\n{self.logs()}")
        return Forked([sys.executable, "-m", "uvicorn", *args], json.loads(reply)["pid"], read_end)

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def close(self) -> None:
        """End the zygote; a server still running gets SIGTERM (PDEATHSIG) as it goes."""
        with self._lock:
            sock, self._socket = self._socket, None
        if sock is None:
            return
        sock.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


_zygote: Zygote | None = None


def enable() -> None:
    """Fork servers from now on (tests/conftest.py), unless TESTS_FRESH_PROCESSES=1."""
    global _zygote
    if os.environ.get("TESTS_FRESH_PROCESSES") != "1" and _zygote is None:
        _zygote = Zygote()


def disable() -> None:
    global _zygote
    zygote, _zygote = _zygote, None
    if zygote is not None:
        zygote.close()


@contextlib.contextmanager
def fresh() -> Iterator[None]:
    """Start fresh interpreters meanwhile (the zygote and its servers go on)."""
    global _zygote
    zygote, _zygote = _zygote, None
    try:
        yield
    finally:
        _zygote = zygote


def spawn(command: list[str], *, cwd: Path, env: dict[str, str], log_path: Path) -> Process:
    """Start ``command``: forked from the zygote when it is on and the command is
    ``python -m uvicorn …``, else a fresh process; output appended to ``log_path``."""
    uvicorn = [sys.executable, "-m", "uvicorn"]
    if _zygote is not None and command[:3] == uvicorn:
        return _zygote.spawn(command[3:], cwd=cwd, env=env, log_path=log_path)
    with log_path.open("ab") as log:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=log)


# -- the zygote's side ---------------------------------------------------------------


def _run_server(request: dict[str, Any]) -> int:
    """In the forked child: become the server of ``request``; its exit code."""
    from app.embedded import die_with_parent

    die_with_parent()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    resource.setrlimit(resource.RLIMIT_NOFILE, tuple(request["nofile"]))
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    import uvicorn.main

    try:
        uvicorn.main.main(args=request["args"], prog_name="uvicorn")
    except SystemExit as exit:
        code = exit.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:
        # As the interpreter does with an uncaught KeyboardInterrupt: die of SIGINT.
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _fork(request: dict[str, Any], closing: list[int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        code = _run_server(request)
    finally:
        logging.shutdown()  # what the interpreter's exit would do for the server's logs
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def _serve(sock: socket.socket) -> None:
    """Fork a server per request; write each one's exit status to its pipe."""
    for module in PRELOADED:  # what every server imports, once here
        importlib.import_module(module)

    # A fork copies only the thread that forks: anything else running here would be lost.
    assert threading.active_count() == 1, threading.enumerate()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    statuses: dict[int, int] = {}  # pid -> the write end of its status pipe
    while True:
        ready, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
        while statuses:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            fd = statuses.pop(pid)
            with contextlib.suppress(BrokenPipeError):  # nobody holds that server any more
                os.write(fd, STATUS.pack(os.waitstatus_to_exitcode(status)))
            os.close(fd)
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1)
            if not data:
                return  # the test session is over
            closing = [sock.fileno(), wake_read, wake_write, *statuses.values(), *fds]
            pid = _fork(json.loads(data), closing)
            for extra in fds[1:]:
                os.close(extra)
            statuses[pid] = fds[0]
            sock.send(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
