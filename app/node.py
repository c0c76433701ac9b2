"""Which node this process is, and which earlier processes of it are provably dead.

A process holds a lock on ``node.lock`` in its data directory for as long as it lives
(a POSIX record lock: the kernel drops it when the process dies, however it dies, and a
child the process forks does not inherit it). Whoever holds the lock writes
``node.json``: the host, the directory and the node ids of the processes that held it
before. So a process that gets the lock knows each of them is dead — it holds what they
held until they died — and takes their orphaned executions over at once, without
waiting for their leases to end: a lone server that restarts picks up its own work.

Nothing else about a name proves a death, so nothing else counts: a second live process
on the same directory does not get the lock (it runs under a new id and takes nothing
early), and a record written on another host or for another directory (a copied or
shared data directory, a volume mounted elsewhere) names processes this one cannot
prove dead, so it is ignored.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

log = logging.getLogger(__name__)

LOCK_FILE = "node.lock"
RECORD_FILE = "node.json"
# Earlier processes remembered: enough for a few restarts in a row that each died
# before it took its predecessors' runs over.
KEPT = 8


@dataclass
class Node:
    """This process's node id; the earlier ones, dead, whose runs it may take at once."""

    id: str
    dead: tuple[str, ...] = ()
    _lock: IO[bytes] | None = field(default=None, repr=False)

    @property
    def held(self) -> bool:
        """True when this process holds the data directory's lock (no other live one)."""
        return self._lock is not None

    def close(self) -> None:
        """Let the next process on this data directory have the node (at exit)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def claim_node(data_dir: Path) -> Node:
    """Take this data directory's node lock and record this process as its holder."""
    node_id = secrets.token_hex(6)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = (data_dir / LOCK_FILE).open("ab")
    except OSError as exc:
        log.warning(
            "no node lock in the data directory; after a restart this process's runs are "
            "recovered once their leases end",
            extra={"dir": str(data_dir), "error": str(exc)},
        )
        return Node(node_id)
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        log.warning(
            "another live process uses this data directory (FLOWCAST_DATA_DIR); give each "
            "process its own, or after a restart its runs are recovered only once their "
            "leases end",
            extra={"dir": str(data_dir.resolve())},
        )
        return Node(node_id)
    here = {"host": socket.gethostname(), "dir": str(data_dir.resolve())}
    record = _read(data_dir / RECORD_FILE)
    dead: tuple[str, ...] = ()
    if record.get("host") == here["host"] and record.get("dir") == here["dir"]:
        dead = tuple(str(node) for node in record.get("nodes", []))[:KEPT]
    try:
        _write(data_dir / RECORD_FILE, {**here, "nodes": [node_id, *dead][:KEPT]})
    except OSError as exc:
        # Not recorded: a successor could not prove this process dead, so nothing of it
        # is taken early; the earlier ones are still this process's to take.
        log.warning("could not record the node", extra={"error": str(exc)})
    return Node(node_id, dead, lock)


def _read(path: Path) -> dict[str, Any]:
    try:
        record = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, orjson.JSONDecodeError) as exc:
        log.warning("unreadable node record ignored", extra={"error": str(exc)})
        return {}
    return record if isinstance(record, dict) else {}


def _write(path: Path, record: dict[str, Any]) -> None:
    # Replaced whole: a crash mid-write leaves the old record, never half of one.
    partial = path.with_suffix(".tmp")
    partial.write_bytes(orjson.dumps(record))
    os.replace(partial, path)
