"""Loopback ports for the tests' own servers, that no other process can take.

A port picked by binding port 0 and letting it go (``app.embedded.free_port``) is a
port of the kernel's ephemeral range: until its server binds it (after a Flowcast
process's startup, a second or two on a busy machine), or while a server is down to be
started again on it (a Valkey killed and restarted, a replica restarted), any other
process binding port 0 may be given it -- the other pytest worker's next pick, a
receiver, a moto or nginx of its own. The restarted server then fails "address already
in use", or a readiness check answered by the other server passes. (A clean-clone run:
the lone-restart test's new server exited 3 with "address already in use".)

The kernel gives out ports only from ``ip_local_port_range`` (32768-60999 by default),
so the ports here are below it; and a pytest process (an xdist worker, or another run
on the same machine) holds a lock on each port it picked (a POSIX record lock on the
byte of that number in one shared file: one descriptor however many ports, released
when the process ends), so no other test process picks it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

from app.embedded import free_port

FIRST_PORT = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOCKS = Path(tempfile.gettempdir()) / "flowcast-test-ports.lock"

_held: set[int] = set()  # the ports this process locked (for good)
_lock_fd: int | None = None  # the shared file's one descriptor (never closed: that
# would let go of every lock this process holds in it)


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: no port is known to be out of the kernel's reach


def _ports() -> list[int]:
    """The ports below the ephemeral range, from a random one on (two processes that
    start together do not try the same ones first)."""
    ports = list(range(FIRST_PORT, _ephemeral_low()))
    if not ports:
        return []
    start = random.randrange(len(ports))
    return ports[start:] + ports[:start]


_ORDER = _ports()
_next = 0


def _locked(port: int) -> bool:
    """Take ``port``'s lock for this process; False if another process holds it."""
    global _lock_fd
    try:
        if _lock_fd is None:
            _lock_fd = _open_locks()
    except OSError:
        return True  # no lock to be had here: the range alone keeps the kernel off it
    try:
        fcntl.lockf(_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    _held.add(port)
    return True


def _open_locks() -> int:
    """The shared file, for every user's test runs: made writable by all (past the
    umask: with 0644, another user's runs could not open it and took ports unlocked,
    their workers the same ones), and opened without O_CREAT when it is there (in a
    sticky /tmp, fs.protected_regular refuses O_CREAT on another user's file)."""
    try:
        fd = os.open(LOCKS, os.O_RDWR)
    except FileNotFoundError:
        fd = os.open(LOCKS, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):  # only its owner may, and needs to
        os.fchmod(fd, 0o666)
    return fd


def _let_go(port: int) -> None:
    """Give back a lock taken for a port another program turned out to use."""
    _held.discard(port)
    if _lock_fd is not None:
        fcntl.lockf(_lock_fd, fcntl.LOCK_UN, 1, port)


def _bindable(port: int) -> bool:
    # Without SO_REUSEADDR: a port with a listener, or with connections in TIME_WAIT
    # from a server this process ran on it before, is passed over.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _take(port: int) -> bool:
    """Lock ``port`` for this process if no process holds it (this one included: a
    port it holds is its own server's, maybe down to be started again on it, or a
    cluster node's bus port) and it is free; a lock is kept only then."""
    if port in _held or not _locked(port):
        return False
    if _bindable(port):
        return True
    _let_go(port)  # another program's port: leave it alone
    return False


def own_port() -> int:
    """A free loopback port below the ephemeral range that this process holds
    (``free_port`` if there is none)."""
    return own_port_pair(0) if _ORDER else free_port()


def own_port_pair(offset: int) -> int:
    """A port as ``own_port``; with ``offset``, ``port + offset`` is held and free too
    (a cluster node's bus port), both below the ephemeral range (or in it, as
    ``free_port``, when the range starts too low for a pair to fit below it)."""
    global _next
    low = _ephemeral_low()
    for _ in range(len(_ORDER)):
        port = _ORDER[_next]
        _next = (_next + 1) % len(_ORDER)
        if offset and port + offset >= low:
            continue
        if _take(port) and (not offset or _take(port + offset)):
            return port
    if not offset:
        return free_port()
    # No pair below the range (it starts below FIRST_PORT + offset, "1024 65535" say):
    # a pair in the kernel's range, as ``free_port``, unguarded while a node is down.
    for _ in range(1_000):
        port = free_port()
        if port + offset < 65_536 and _take(port) and _take(port + offset):
            return port
    raise RuntimeError(f"no free pair of loopback ports {offset} apart")
