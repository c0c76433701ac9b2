"""What a recovery must look like in a stored log, and who owns what when a replica is
lost (SPEC §4 ``execution:recovered``, §7 "Recovery", "Shutdown hands work off").

``recovery_problems`` holds the ``execution:recovered`` events of one stored log to the
rules: numbered 1, 2, … in order; each one's ``completed`` is exactly the blocks whose
``block:completed`` is stored before it, none of them starts again after it, and
``rerun`` shares no block with it. A log with a hole before a recovery (ids the ring
evicted or the store dropped) is held to what it shows: every block seen completed
before the recovery is kept, and a number may be skipped across the hole.

``running_owners`` reads straight from Valkey which process owns each running
execution, so a scenario can SIGKILL or SIGTERM the replica that owns the most and then
check that each of those executions was carried on elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from redis.asyncio import Redis

from lib.backend import Keys
from lib.execution.ownership import node_of

RECOVERED = "execution:recovered"
REASONS = ("worker_lost", "handoff")


def recovery_problems(log: Sequence[dict[str, Any]]) -> list[str]:
    """Every way the recoveries of one stored log (ids increasing) break the rules."""
    problems: list[str] = []
    expected = 1
    for index, event in enumerate(log):
        if event["type"] != RECOVERED:
            continue
        data = event["data"]
        where = f"id {event['id']} (recovery {data.get('recovery')}, {data.get('reason')})"
        whole = log[0]["id"] == 1 and event["id"] == index + 1  # no hole before it
        number = data.get("recovery")
        if not isinstance(number, int) or number < expected or (number > expected and whole):
            problems.append(f"{where}: numbered {number}, expected {expected}")
        expected = (number if isinstance(number, int) else expected) + 1
        if data.get("reason") not in REASONS:
            problems.append(f"{where}: reason {data.get('reason')!r}")
        kept, rerun = set(data.get("completed", ())), set(data.get("rerun", ()))
        if kept & rerun:
            problems.append(f"{where}: {sorted(kept & rerun)} both kept and re-run")
        before = {e["data"]["blockId"] for e in log[:index] if e["type"] == "block:completed"}
        if whole and kept != before:
            problems.append(
                f"{where}: kept {sorted(kept)}, but the blocks completed before it are "
                f"{sorted(before)}"
            )
        elif before - kept:
            problems.append(f"{where}: {sorted(before - kept)} completed before it, not kept")
        again = {e["data"]["blockId"] for e in log[index + 1 :] if e["type"] == "block:started"}
        if kept & again:
            problems.append(f"{where}: kept {sorted(kept & again)} started again after it")
    return problems


def recoveries(log: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``execution:recovered`` events of a log."""
    return [event for event in log if event["type"] == RECOVERED]


def stamp(envelope: dict[str, Any]) -> float:
    """When an event was emitted (wall clock, seconds)."""
    return datetime.fromisoformat(envelope["ts"]).timestamp()


def move_problem(
    log: Sequence[dict[str, Any]],
    *,
    kind: str,
    signalled_wall: float,
    exited_wall: float,
    within: float,
) -> str | None:
    """How a run of a process lost by ``kind`` (kill: SIGKILL, term: SIGTERM) at
    ``signalled_wall`` failed to move, or None: it ended first (or is reported as not
    completed elsewhere), ended on the process while that drained, or was recovered
    after the signal (``worker_lost`` after a kill, ``handoff`` after a term) within
    ``within`` seconds."""
    reason = "worker_lost" if kind == "kill" else "handoff"
    if not log or log[-1]["type"] != "execution:completed" or stamp(log[-1]) <= signalled_wall:
        return None
    moved = [e for e in recoveries(log) if stamp(e) > signalled_wall]
    if not moved:
        if kind == "term" and stamp(log[-1]) <= exited_wall:
            return None
        return "no execution:recovered after the signal"
    if moved[0]["data"]["reason"] != reason:
        return f"recovered {moved[0]['data']}, expected {reason}"
    late = stamp(moved[0]) - signalled_wall
    return f"recovered {late:.1f} s after the signal" if late > within else None


async def running_owners(redis: Redis, accepted: Mapping[str, int]) -> dict[int, list[str]]:
    """The running executions by the port of the process that owns them.

    ``accepted`` maps each execution to the port of the process that answered its
    execute. A process's node (the first part of its fencing tokens) is learnt from an
    execution it still holds under the token it accepted it with (epoch 1); executions
    owned by a process not learnt that way are left out."""
    keys = Keys()
    execution_ids = list(accepted)
    async with redis.pipeline(transaction=False) as pipe:
        for execution_id in execution_ids:
            pipe.hmget(keys.meta(execution_id), "owner", "epoch", "status")
        rows = await pipe.execute()
    ports: dict[str, int] = {}
    running: dict[str, list[str]] = {}
    for execution_id, (owner, epoch, status) in zip(execution_ids, rows, strict=True):
        if not owner:
            continue  # handed off, or gone
        node = node_of(owner.decode())
        if epoch == b"1":
            ports.setdefault(node, accepted[execution_id])
        if status == b"running":
            running.setdefault(node, []).append(execution_id)
    return {ports[node]: owned for node, owned in running.items() if node in ports}


def work_problems(log: Sequence[dict[str, Any]], workflow: dict[str, Any]) -> list[str]:
    """What a run that may have been recovered must still show, in a whole stored log:
    every block completed exactly once; a block started again only after a recovery
    between its runs, with a higher attempt each time; each run of a ``generate`` block
    streams a prefix of its text, the last run all of it."""
    problems: list[str] = []
    for block in workflow["blocks"]:
        name = block["id"]
        runs: list[list[str]] = []  # the chunks of each run of the block
        attempts: list[int] = []
        completed = 0
        since_start = 0  # recoveries since the block's last start
        for event in log:
            data = event["data"]
            if event["type"] == RECOVERED:
                since_start += 1
            elif data.get("blockId") != name:
                continue
            elif event["type"] == "block:started":
                if runs and not since_start:
                    problems.append(f"block {name} started again at id {event['id']} "
                                    "with no recovery since its last start")  # fmt: skip
                runs.append([])
                attempts.append(data.get("attempt", 0))
                since_start = 0
            elif event["type"] == "block:chunk" and runs:
                runs[-1].append(data["text"])
            elif event["type"] == "block:completed":
                completed += 1
        if completed != 1:
            problems.append(f"block {name} completed {completed}x (started {len(runs)}x)")
        if attempts != sorted(set(attempts)):
            problems.append(f"block {name} ran with attempts {attempts}")
        if block["type"] == "generate" and runs:
            text = block["config"]["text"]
            streamed = ["".join(chunks) for chunks in runs]
            if streamed[-1] != text or any(not text.startswith(part) for part in streamed):
                problems.append(f"block {name}'s runs streamed {[s[:40] for s in streamed]}")
    return problems
