"""The fault storm's verdict: every rule it proves, checked on what it collected.

A broken rule is a finding of one kind (the text in brackets); a storm of the same
failure is reported once per kind with its count and one concrete example. The rules:

- ``gone``: an execution that got a 202 still exists at the end, unless a restart of
  Valkey that lost data (empty, or from a snapshot older than the execution) took it
  while it was at rest; ``gone after running on`` if it kept emitting after that;
- ``not terminal``: every snapshot is terminal within lease + grace (plus the run's own
  length) of the end of the load;
- ``stored log``: the stored log passes ``check_lossy_log`` (holes only where a dropped
  range explains them, one terminal event, last);
- ``id reused``: no id names two different events, among the stored log and every copy
  any client received, live or replayed (same type and same envelope);
- ``bad view``, ``frame after terminal``, ``open after terminal``, ``odd cursor``,
  ``stuck stream``, ``late stream end``, ``stream 404``, ``stream refused``: each client's
  events are ordered, without duplicates, holes only behind a ``replay:gap``; its stream
  ends (terminal event, 204, or 404 for an execution a restart took) within lease +
  grace of the terminal event being stored;
- ``resume not applied``, ``cancel not applied``, ``resumes won``: every 202 to a resume
  or cancel took effect (the log has that ``execution:resumed`` input, or ends
  ``execution:cancelled``), and of concurrent resumes of one confirmed pause exactly one
  got a 202 (never more than one);
- ``failed, not recovered``, ``failed by a shutdown``: an owner that died or stalled
  past its lease is recovered (``execution:recovered``, and the run carries on) until
  ``FLOWCAST_MAX_RECOVERIES`` (3) recoveries, and a SIGTERM hands work off instead of
  failing it (SPEC §7 "Recovery", "Shutdown hands work off");
- ``owner lost``, ``not recovered``, ``no handoff``: every execution running on the
  replica that was SIGKILLed or SIGTERMed (the storm picks the one that runs the most)
  ends ``completed``, unless a cancel was sent to it, its approval timed out, it crashed
  past the recoveries allowed, or a restart of Valkey that lost data took its state or
  the execution itself; one that did not end before the signal has an
  ``execution:recovered`` after it, a ``handoff`` for a SIGTERM (unless a Valkey fault
  was on while the replica drained);
- ``recovery``: each ``execution:recovered`` is consistent (``stress/recoveries.py``):
  numbered 1, 2, … in order, its ``completed`` the blocks stored completed before it,
  none of which starts again;
- ``footprint``: the sum of ``MEMORY USAGE`` over an execution's keys stays under the
  budget plus 64 KiB, sampled every second and at the end;
- ``5xx``: no 5xx except a 503 while Valkey is down, paused or asleep (and a little
  after), or from a replica that is draining;
- ``traceback``: no traceback in any server's log.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from stress.fault_plan import BUDGET_BYTES, LEASE_SECONDS, VALKEY_FAULTS
from stress.fault_records import Answer, Fault, Reader, Run
from stress.recoveries import recoveries, recovery_problems, stamp
from tests.support.logcheck import TERMINAL, check_lossy_log, check_view

if TYPE_CHECKING:
    from stress.fault_storm import Storm
    from tests.support.servers import FlowcastServer

SLACK_BYTES = 64 * 1024
MAX_RECOVERIES = 3  # FLOWCAST_MAX_RECOVERIES' default
HEAL_SECONDS = 3.0  # a 503 this soon after Valkey is back is still the outage's
RAN_ON_SECONDS = 1.0  # events stamped this long after a restart were emitted after it


class Findings:
    """Broken rules by kind: how often, and the first example."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[int, str]] = {}

    def add(self, kind: str, example: str) -> None:
        count, first = self.kinds.get(kind, (0, example))
        self.kinds[kind] = (count + 1, first)

    def lines(self) -> list[str]:
        return [
            f"[{kind}] x{count}, e.g. {example}" for kind, (count, example) in self.kinds.items()
        ]


def judge(storm: Storm) -> None:
    """Check every rule on the collected storm; findings go to the storm's report."""
    found = Findings()
    for problem in storm.start_problems:
        found.add("execute refused", problem)
    outcomes: Counter[str] = Counter()
    excused = Counter[str]()
    for run in storm.accepted:
        outcomes[outcome(run)] += 1
        check_run(storm, run, found, excused)
        check_ending(storm, run, found)
        check_recoveries(run, found)
    for fault in storm.faults:
        check_owner_lost(storm, fault, found)
    check_errors(storm, found)
    for server in storm.live.servers:
        check_logs(server, found)
    report = storm.report
    readers = [reader for run in storm.accepted for reader in run.readers]
    report.executions = len(storm.accepted)
    report.views = len(readers)
    report.figures.update(
        planned=len(storm.runs),
        owned_at_replica_faults=[len(fault.owned) for fault in storm.faults if fault.detail],
        recovered=dict(
            Counter(
                event["data"].get("reason")
                for run in storm.accepted
                for event in recoveries(run.log or run.log_before_loss or [])
            )
        ),
        outcomes=dict(sorted(outcomes.items())),
        faults=len(storm.faults),
        peak_kib=round(max((peak for peak, _ in storm.peaks.values()), default=0) / 1024),
        gaps=sum(frame.event == "replay:gap" for reader in readers for frame in reader.frames),
        reconnects=sum(reader.connections - 1 for reader in readers),
        broken_streams=sum(reader.broken_frames + reader.transport_errors for reader in readers),
        lost_with_the_store=dict(excused),
        checked_before_loss=sum(
            run.log is None and run.log_before_loss is not None for run in storm.accepted
        ),
    )
    for line in found.lines():
        report.find(line)


def outcome(run: Run) -> str:
    if run.status is None or run.status == "gone":
        return "gone"
    if run.log and run.log[-1]["type"] == "execution:failed":
        return f"failed:{run.log[-1]['data'].get('error', {}).get('code')}"
    return run.status


def check_run(storm: Storm, run: Run, found: Findings, excused: Counter[str]) -> None:
    eid, kind = run.execution_id, run.plan.kind
    losses = lost_by(storm, run)
    if run.log_before_loss is not None:
        try:
            check_lossy_log(run.log_before_loss, dropped=run.dropped_before_loss)
        except AssertionError as exc:
            found.add("stored log", f"{eid} ({kind}), as stored before a restart: {exc}")
    if run.log is None:
        if not losses:
            found.add("gone", f"{eid} ({kind}): 404 at the end, and no restart of Valkey lost it")
        else:
            check_ran_on(run, losses[-1], found)
    else:
        if run.terminal_wall is None:
            open_streams = sum(not reader.ended for reader in run.readers)
            found.add(
                "not terminal",
                f"{eid} ({kind}, {run.plan.action}): status {run.status} "
                f"{storm.shape.settle:.0f} s after the load ended; last stored event "
                f"{run.log[-1]['id']} {run.log[-1]['type']}; {open_streams} streams still open",
            )
        try:
            check_lossy_log(run.log, dropped=run.dropped)
        except AssertionError as exc:
            found.add("stored log", f"{eid} ({kind}): {exc}")
    check_ids(run, found)
    for reader in run.readers:
        check_reader(storm, run, reader, bool(losses), found)
    check_answers(storm, run, found, excused)
    peak, parts = storm.peaks.get(eid, (0, {}))
    if peak > BUDGET_BYTES + SLACK_BYTES:
        breakdown = ", ".join(f"{name} {size // 1024} KiB" for name, size in sorted(parts.items()))
        found.add(
            "footprint",
            f"{eid} ({kind}): {peak // 1024} KiB in Redis ({breakdown}), over the budget "
            f"{BUDGET_BYTES // 1024} KiB + {SLACK_BYTES // 1024} KiB",
        )


def lost_by(storm: Storm, run: Run) -> list[Fault]:
    """The data-losing restarts that may have taken this execution away: it was created
    after the data they restored and before they ended."""
    return [
        fault
        for fault in storm.faults
        if fault.lost_since_wall is not None
        and run.accepted_wall >= fault.lost_since_wall
        and run.sent_wall <= (fault.ended_wall or float("inf"))
    ]


def check_ran_on(run: Run, fault: Fault, found: Findings) -> None:
    """A gone execution must not have been running on after the store came back."""
    after = [
        envelope
        for reader in run.readers
        for envelope in envelopes_of(reader)
        if stamp(envelope) > fault.ended_wall + RAN_ON_SECONDS
    ]
    if after:
        last = max(after, key=lambda envelope: envelope["id"])
        found.add(
            "gone after running on",
            f"{run.execution_id} ({run.plan.kind}): 404 at the end, yet clients got "
            f"{len(after)} events emitted after Valkey came back from {fault.kind} (up to "
            f"{last['id']} {last['type']}): the store never had them",
        )


def check_ending(storm: Storm, run: Run, found: Findings) -> None:
    """A lost owner means a recovery, a SIGTERM a handoff: neither fails the execution."""
    log = run.log or run.log_before_loss
    if not log or log[-1]["type"] != "execution:failed":
        return
    code = log[-1]["data"].get("error", {}).get("code")
    recoveries = sum(envelope["type"] == "execution:recovered" for envelope in log)
    ended = stamp(log[-1])
    before = [fault for fault in storm.faults if fault.began_wall <= ended]
    last = f"{before[-1].kind} {ended - before[-1].began_wall:.1f} s before" if before else "none"
    where = f"{run.execution_id} ({run.plan.kind}): id {log[-1]['id']}"
    if code == "worker_lost" and recoveries < MAX_RECOVERIES:
        found.add(
            "failed, not recovered",
            f"{where} execution:failed worker_lost after {recoveries} recoveries (last fault: "
            f"{last}); expected execution:recovered and the run carried on",
        )
    elif code == "shutdown":
        found.add(
            "failed by a shutdown",
            f"{where} execution:failed shutdown (last fault: {last}); expected a handoff",
        )


def check_recoveries(run: Run, found: Findings) -> None:
    """Each ``execution:recovered`` kept what the log had completed, and only that."""
    for source, log in (("", run.log), (", as stored before a restart", run.log_before_loss)):
        problems = recovery_problems(log or [])
        if problems:
            example = f"{problems[0]} ({len(problems)} problems)"
            found.add("recovery", f"{run.execution_id} ({run.plan.kind}){source}: {example}")


def check_owner_lost(storm: Storm, fault: Fault, found: Findings) -> None:
    """Every execution running on a replica when it was SIGKILLed or SIGTERMed ends
    ``completed``, carried on elsewhere (a handoff for a SIGTERM) unless it ended first."""
    if fault.kind not in ("replica-kill", "replica-term"):
        return
    runs = {run.execution_id: run for run in storm.accepted}
    for execution_id in fault.owned:
        run = runs[execution_id]
        log = run.log or run.log_before_loss
        if not log or log[-1]["type"] not in TERMINAL:
            continue  # reported as gone or as not terminal
        end = log[-1]
        plan = f"{run.plan.kind}, {run.plan.action}"
        where = f"{execution_id} ({plan}), {fault.kind} of {fault.detail}"
        if end["type"] != "execution:completed":
            if not excused(storm, run, end):
                error = end["data"].get("error", {})
                found.add(
                    "owner lost",
                    f"{where}: ended {end['id']} {end['type']} {error.get('code', '')} "
                    f"{stamp(end) - fault.began_wall:.1f} s after the signal",
                )
            continue  # a cancel, or a state a restart of Valkey took, ends it unrecovered
        if stamp(end) <= fault.began_wall:
            continue  # it ended before the signal
        before = [event for event in log if stamp(event) <= fault.began_wall]
        if before and before[-1]["type"] == "execution:paused":
            continue  # it paused right before the signal: a resume moves it, not a recovery
        moved = [event for event in recoveries(log) if stamp(event) > fault.began_wall]
        whole = [event["id"] for event in log] == list(range(1, len(log) + 1))
        if not moved and not whole:
            continue  # the store lost events: a recovery may be among them
        if not moved:
            if fault.kind == "replica-term" and stamp(end) <= fault.ended_wall:
                continue  # it ended on the replica while it drained
            found.add(
                "not recovered",
                f"{where}: no execution:recovered after the signal, yet it ended "
                f"{stamp(end) - fault.began_wall:.1f} s after it ({end['type']})",
            )
        elif fault.kind == "replica-term" and moved[0]["data"].get("reason") != "handoff":
            drained = (fault.began_wall, fault.ended_wall + LEASE_SECONDS)
            if not any(overlaps_wall(other, *drained) for other in storm.faults):
                found.add(
                    "no handoff",
                    f"{where}: recovered {moved[0]['data']} "
                    f"{stamp(moved[0]) - fault.began_wall:.1f} s after the SIGTERM",
                )


def excused(storm: Storm, run: Run, end: dict[str, Any]) -> bool:
    """An ending other than ``completed`` that the run's plan or a fault explains."""
    if end["type"] == "execution:cancelled":
        return any(answer.kind == "cancel" for answer in run.answers)
    code = end["data"].get("error", {}).get("code")
    if code in ("worker_lost", "shutdown"):
        return True  # judged by check_ending
    if code == "approval_timeout":
        return run.plan.kind == "ask-timeout"
    if code == "state_lost":
        return any(
            fault.lost_since_wall is not None and run.sent_wall <= fault.began_wall <= stamp(end)
            for fault in storm.faults
        )
    return False


def overlaps_wall(fault: Fault, low: float, high: float) -> bool:
    """A Valkey fault in effect at some point between ``low`` and ``high`` (wall clock)."""
    return (
        fault.kind in VALKEY_FAULTS
        and fault.began_wall <= high
        and (fault.ended_wall or float("inf")) >= low
    )


def check_ids(run: Run, found: Findings) -> None:
    """No id names two different events across the stored log and every client."""
    seen: dict[int, tuple[str, dict[str, Any]]] = {}
    sources: list[tuple[str, list[dict[str, Any]]]] = [
        ("the store", run.log or []),
        ("the store before a restart", run.log_before_loss or []),
    ]
    sources += [(reader.label, envelopes_of(reader)) for reader in run.readers]
    clashes: list[str] = []
    for source, envelopes in sources:
        for envelope in envelopes:
            first = seen.setdefault(envelope["id"], (source, envelope))
            if first[1] != envelope:
                other = first[1]
                same = "two events" if other["type"] != envelope["type"] else "two envelopes"
                clashes.append(
                    f"id {envelope['id']} names {same}: {first[0]} has {other['type']} "
                    f"{other['ts']}, {source} has {envelope['type']} {envelope['ts']}"
                )
    if clashes:
        example = f"{clashes[0]} ({len(clashes)} ids clash)"
        found.add("id reused", f"{run.execution_id} ({run.plan.kind}): {example}")


def check_reader(storm: Storm, run: Run, reader: Reader, lossy: bool, found: Findings) -> None:
    eid = run.execution_id
    label = f"{eid} ({run.plan.kind}) {reader.label}"
    if reader.role == "odd":
        # A cursor above the stored log gets the terminal event and nothing else (SPEC §5
        # as amended in step 15: never a bare end, whatever the terminal's id).
        got = [(frame.id, frame.event) for frame in reader.frames if frame.id is not None]
        if got and (len(got) > 1 or got[0][1] not in TERMINAL):
            found.add("odd cursor", f"{label}: got events {got[:5]}, only the terminal may come")
    else:
        try:
            check_view(reader.frames, after=reader.start)
        except AssertionError as exc:
            found.add("bad view", f"{label}: {exc}")
    if reader.late_frames:
        frame = reader.late_frames[0]
        found.add("frame after terminal", f"{label}: {frame.event} id={frame.id} came after it")
    if reader.kept_open:
        found.add("open after terminal", f"{label}: still open 3 s after the terminal event")
    if reader.ended.startswith("answered"):
        found.add("stream refused", f"{label}: {reader.ended}")
    if reader.ended == "404" and not lossy:
        found.add("stream 404", f"{label}: 404, and no restart of Valkey lost the execution")
    terminal = terminal_stamp(run)
    if run.terminal_wall is None and run.log is not None:
        return  # the execution never ended: reported once, as not terminal
    if not reader.ended:
        since = f"its terminal event was stored at {terminal:.1f}" if terminal else "it is gone"
        found.add(
            "stuck stream",
            f"{label}: still open {storm.shape.stream_end:.0f} s after the load settled "
            f"({since}); last id {reader.cursor}, {len(reader.frames)} frames",
        )
    elif terminal and reader.ended_wall > terminal + storm.shape.stream_end:
        # A reader still busy taking frames is slow, not stuck: only a silence counts.
        times = [terminal, *(t for t in reader.stamps if t > terminal), reader.ended_wall]
        silence = max(later - earlier for earlier, later in pairwise(times))
        if silence > storm.shape.stream_end:
            found.add(
                "late stream end",
                f"{label}: ended ({reader.ended}) {reader.ended_wall - terminal:.1f} s after "
                f"the terminal event was stored, after {silence:.1f} s without a frame",
            )


def check_answers(storm: Storm, run: Run, found: Findings, excused: Counter[str]) -> None:
    """Every 202 took effect; of concurrent resumes of one confirmed pause, exactly one won."""
    eid = run.execution_id
    copies = [run.log or [], run.log_before_loss or []]
    copies += [envelopes_of(reader) for reader in run.readers]
    every = [envelope for log in copies for envelope in log]
    resumed = [e["data"].get("input") for e in every if e["type"] == "execution:resumed"]
    cancelled = any(envelope["type"] == "execution:cancelled" for envelope in every)
    ends = run.log[-1]["type"] if run.log else "gone"
    for answer in run.answers:
        if answer.status != 202:
            continue
        applied = answer.input in resumed if answer.kind == "resume" else cancelled
        if applied:
            continue
        if run.log is None or store_lost(storm, answer):
            excused[answer.kind] += 1
            continue
        what = f"input {answer.input}" if answer.kind == "resume" else "the cancel"
        found.add(
            f"{answer.kind} not applied",
            f"{eid} ({run.plan.kind}, {run.plan.action}): a 202 to {what} ({answer.group}), "
            f"but the log has {len(resumed)} resumes {resumed[:2]} and ends {ends}",
        )
    groups: dict[str, list[Answer]] = {}
    for answer in run.answers:
        groups.setdefault(answer.group, []).append(answer)
    for group, answers in groups.items():
        resumes = [answer for answer in answers if answer.kind == "resume"]
        won = [answer for answer in resumes if answer.status == 202]
        codes = [(answer.kind, answer.status) for answer in answers]
        if len(won) > 1:
            example = f"{len(won)} of {len(resumes)} concurrent resumes got 202 ({group}: {codes})"
            found.add("resumes won", f"{eid}: {example}")
        confirmed = (
            resumes
            and run.plan.kind == "ask"
            and all(answer.paused_before for answer in answers)
            and all(answer.kind == "resume" and answer.status in (202, 409) for answer in answers)
            and not any(overlaps(storm, answer) for answer in answers)
        )
        if confirmed and not won:
            example = f"none of {len(resumes)} resumes of a confirmed pause got 202 ({codes})"
            found.add("resumes won", f"{eid}: {example}")


def store_lost(storm: Storm, answer: Answer) -> bool:
    """A data-losing restart came after this answer and restored data older than it."""
    return any(
        fault.lost_since_wall is not None
        and fault.lost_since_wall <= answer.answered_wall <= (fault.ended_wall or float("inf"))
        for fault in storm.faults
    )


def overlaps(storm: Storm, answer: Answer) -> bool:
    return any(
        fault.kind in VALKEY_FAULTS
        and fault.began - 0.5 <= answer.answered
        and answer.sent <= (fault.ended or float("inf")) + 0.5
        for fault in storm.faults
    )


def check_errors(storm: Storm, found: Findings) -> None:
    """No 5xx except a 503 while Valkey is faulty (and a little after) or a replica drains."""
    windows = [
        (fault.began_wall, (fault.ended_wall or float("inf")) + HEAL_SECONDS)
        for fault in storm.faults
        if fault.kind in VALKEY_FAULTS
    ]
    for error in storm.live.errors:
        if error.status == 503 and (
            error.port in storm.live.draining_ports
            or any(low <= error.wall <= high for low, high in windows)
        ):
            continue
        healed = max((high - HEAL_SECONDS for _, high in windows if high <= error.wall), default=0)
        when = f"{error.wall - healed:.1f} s after the last Valkey fault" if healed else "no fault"
        request = f"{error.method} {error.path} on port {error.port}"
        found.add("5xx", f"{error.status} from {request} ({when}): {error.body}")


def check_logs(server: FlowcastServer, found: Findings) -> None:
    """No traceback in a server's log."""
    for line in server.logs().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            if "Traceback" in line:
                found.add("traceback", f"port {server.port}: {line[:200]}")
            continue
        exception = str(entry.get("exception", "")).strip().splitlines()
        if exception:
            where = f"port {server.port}, {entry.get('executionId', 'no execution')}"
            found.add("traceback", f"{where}: {entry.get('message')}: {exception[-1][:200]}")


# -- small helpers ---------------------------------------------------------------------


def envelopes_of(reader: Reader) -> list[dict[str, Any]]:
    return [frame.json for frame in reader.frames if frame.id is not None]


def terminal_stamp(run: Run) -> float | None:
    """When the stored terminal event was emitted (wall clock), if it is stored."""
    for log in (run.log, run.log_before_loss):
        if log and log[-1]["type"] in TERMINAL:
            return stamp(log[-1])
    return None
