"""The verdict of the queue storm (``stress/queue_storm.py``): each broken rule is a
finding.

- every accepted execution has exactly one terminal event: its stored log passes
  ``check_log`` and ends ``completed`` (or ``failed`` ``quarantined`` after two
  recoveries at least: blame.py's documented end of a run whose owners kept dying);
  each block completed once, ran again only after a recovery, the last block echoes
  the first (``work_problems``), and each ``execution:recovered`` is consistent
  (``recovery_problems``);
- every client's view equals the stored log from its cursor (no id reused, no
  duplicate, no hole, no gap); ``queue`` frames (no id) come only before
  ``execution:started``;
- every execution the lost worker owned that had not ended by the signal has an
  ``execution:recovered`` after it (``worker_lost`` for a SIGKILL, ``handoff`` for a
  SIGTERM unless it ended on the draining worker) within ``MOVED_SECONDS``;
- fairness: in phase A (the heavy tenant backlogged, the light one starting at a steady
  pace) the light tenant's wait (``queuedMs`` of its ``execution:started``) p99 stays
  within ``WAIT_TURNOVERS`` slot turnovers, the turnover measured in the same window
  (the live workers' slot-seconds over the runs that took a slot, ``_turnover``),
  over the light starts queued while the heavy line held work; one queued across a
  worker loss is held instead to starting within ``MOVED_SECONDS`` of the signal; in
  phase B (both lines non-empty) the light tenant's share of starts (light ÷ heavy) is
  within ``SHARE_BOUNDS``;
- the queue's keys once every execution ended hold only the backlog (none): no line,
  no waiting tenant, no delivery in ``taken``, no running entry left but ones of the
  last lease; the streams have no consumer group beyond the live workers and no
  pending entry; a control stream of a process gone expires;
- no 5xx, no refused execute, no error line or traceback in any process's log, but a
  writer refused as ``fenced`` (``stalled_owners``).
"""

from __future__ import annotations

import json
import statistics
from bisect import bisect_right
from collections import Counter
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from stress.harness import View, server_errors, verify
from stress.queue_plan import GRACE_SECONDS, LEASE_SECONDS, SLOTS, Execution, Loss
from stress.recoveries import move_problem, recoveries, recovery_problems, stamp, work_problems
from tests.support.logcheck import TERMINAL, check_log

if TYPE_CHECKING:
    from stress.queue_storm import QueueStorm

MOVED_SECONDS = LEASE_SECONDS + GRACE_SECONDS + 3.0  # a signal to execution:recovered
# The same for a run whose owner had died before (a suspect, blame.py): processes take
# suspects one at a time each, a lease apart, so under a kill every second or two they
# queue up; bounded all the same (a run left behind is a finding).
SUSPECT_SECONDS = 20.0
RECOVERED_EVENT = "execution:recovered"
WAIT_TURNOVERS = 3.0
FENCED = '"message":"buffer refused the writer; its events stay unstored"'
SHARE_BOUNDS = (0.8, 1.25)


def stalled_owners(logs: str) -> tuple[str, int]:
    """A server's log without the error lines of a writer refused as ``fenced``, and
    how many there were. A live worker starved of CPU past its lease (1 s here, on a
    machine shared with other work) has its runs taken over, as SPEC §7 says, and its
    next write refused: logged at error level, counted here, not a finding (the run's
    stored log and its client are checked all the same)."""
    kept, fenced = [], 0
    for line in logs.splitlines():
        if FENCED in line and '"reason":"fenced"' in line:
            fenced += 1
        else:
            kept.append(line)
    return "\n".join(kept), fenced


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


class QueueVerdict:
    """Holds one storm's records to the rules of the module docstring."""

    def __init__(self, storm: QueueStorm) -> None:
        self.storm = storm
        self.report = storm.report
        self.tally: Counter[str] = Counter(lost=0, stuck=0, reused=0)

    def judge(self) -> None:
        report, storm = self.report, self.storm
        for refusal in storm.refused:
            report.find(refusal)
        accepted = [e for e in storm.executions if e.execution_id]
        for execution in storm.executions:
            if not execution.execution_id:
                report.find(f"{execution.tenant} execution {execution.number}: never accepted")
        for execution in accepted:
            self._execution(execution)
        by_id = {e.execution_id: e for e in accepted}
        for loss in storm.losses:
            self._loss(loss, by_id)
        self._leftovers()
        processes = [p for p in [storm.api, *storm.every_worker] if p is not None]
        logs = [stalled_owners(server.logs()) for server in processes]
        errors = [line for rest, _ in logs for line in server_errors(rest)]
        report.figures["server_errors"] = len(errors)
        report.figures["stalled_owners_fenced"] = sum(fenced for _, fenced in logs)
        for line in errors:
            report.find(f"error line in a server log: {line}")
        report.executions = len(accepted)
        report.figures.update(self.tally)
        self._figures(accepted)
        self._fairness(accepted)
        self._record(accepted)

    def _record(self, accepted: list[Execution]) -> None:
        """``queue-storm.json`` beside the server logs: the seed, each worker lost and
        each execution's course, what a finding is checked against."""
        storm = self.storm
        record = {
            "seed": storm.seed,
            "began": storm.began_wall,
            "losses": [
                {"kind": x.kind, "at": round(x.at, 2), "node": x.node, "used": x.used,
                 "signalled": x.signalled_wall, "exited": x.exited_wall,
                 "restartAfter": x.restart_after, "owned": x.owned}
                for x in storm.losses
            ],
            "executions": [
                {"id": x.execution_id, "tenant": x.tenant, "phase": x.phase,
                 "workflow": x.workflow["id"], "posted": x.posted_wall,
                 "queuedMs": x.log[0]["data"].get("queuedMs") if x.log else None,
                 "events": [(e["id"], e["type"], e["ts"]) for e in x.log],
                 "seen": [f.id for f in x.view.frames] if x.view else [],
                 "connections": x.view.connections if x.view else 0}
                for x in accepted
            ],
        }  # fmt: skip
        (storm.root / "queue-storm.json").write_text(json.dumps(record))

    # -- each execution --------------------------------------------------------------

    def _execution(self, execution: Execution) -> None:
        log, eid = execution.log, execution.execution_id
        why = self._losses_of(eid)
        self._tally(execution)
        try:
            check_log(log)
        except AssertionError as exc:
            head = ", ".join(f"{e['id']} {e['type']}" for e in log[:2])
            self.report.find(f"{eid}: stored log ({head}, …) fails check_log: {exc}{why}")
            return
        if execution.view is not None:
            self._queue_frames(execution.view)
            verify(self.report, log, [execution.view])
        end = log[-1]
        moved = recoveries(log)
        if end["type"] != "execution:completed":
            code = end["data"].get("error", {}).get("code", "")
            # blame.py quarantines a run at its third death (as its process's suspect):
            # seen as three kills of a worker running it, or two recoveries and the end.
            kills = sum(x.kind == "kill" and eid in x.owned for x in self.storm.losses)
            lost = sum(e["data"]["reason"] == "worker_lost" for e in moved)
            if not (code == "quarantined" and max(kills, lost + 1) >= 3):
                self.report.find(f"{eid}: ended {end['type']} {code} at id {end['id']}{why}")
            return
        for problem in work_problems(log, execution.workflow) + recovery_problems(log):
            self.report.find(f"{eid} ({execution.workflow['id']}): {problem}{why}")
        intro = next(e for e in log if e["type"] == "block:completed")["data"]["output"]
        if intro != {"n": execution.number} or end["data"]["output"] != {"done": intro}:
            self.report.find(f"{eid}: intro {intro}, output {end['data']['output']}")

    def _tally(self, execution: Execution) -> None:
        """The target's three counts (issue 25): executions lost (no terminal event
        stored), stuck (their client had none by its deadline), and ids reused (an id
        a client saw twice, or naming another event than the stored one)."""
        log, view = execution.log, execution.view
        if not log or sum(e["type"] in TERMINAL for e in log) != 1:
            self.tally["lost"] += 1
        if view is None or view.stuck or not view.finished:
            self.tally["stuck"] += 1
        if view is None:
            return
        stored = {e["id"]: e for e in log}
        seen = [f.json for f in view.frames if f.id is not None and f.event != "queue"]
        ids = [e["id"] for e in seen]
        if len(ids) != len(set(ids)) or any(stored.get(e["id"]) != e for e in seen):
            self.tally["reused"] += 1

    def _queue_frames(self, view: View) -> None:
        """Take the ``queue`` frames (no id: a place in line) out of the view, so the
        rest is the events; one after ``execution:started`` is a finding."""
        started = False
        kept = []
        for frame in view.frames:
            if frame.event == "queue":
                place = frame.json
                if started or place.get("state") != "queued" or place.get("ahead", -1) < 0:
                    self.report.find(f"{view.execution_id}: queue frame {place}, started {started}")
                figures = self.report.figures
                figures["queue_frames"] = figures.get("queue_frames", 0) + 1
                continue
            started = started or frame.event == "execution:started"
            kept.append(frame)
        view.frames = kept

    def _losses_of(self, execution_id: str) -> str:
        kinds = [f"{loss.kind}@{loss.at:.1f}" for loss in self.storm.losses
                 if execution_id in loss.owned]  # fmt: skip
        return f"; on a lost worker at {', '.join(kinds)}" if kinds else ""

    # -- each lost worker ------------------------------------------------------------

    def _loss(self, loss: Loss, by_id: dict[str, Execution]) -> None:
        for execution_id in loss.owned:
            log = by_id[execution_id].log
            problem = move_problem(
                log,
                kind=loss.kind,
                signalled_wall=loss.signalled_wall,
                exited_wall=loss.exited_wall,
                within=self._bound(log, loss),
            )
            if problem:
                where = f"{execution_id}, running on {loss.node} at its {loss.kind}@{loss.at:.1f}"
                self.report.find(f"{where}: {problem}")

    @staticmethod
    def _died_before(log: list[dict[str, Any]], loss: Loss) -> bool:
        """Whether the run had lost an owner before this loss: a suspect now (blame.py,
        two deaths), which a process takes only while it runs no other suspect, so its
        recovery may wait for one without (each holds one a probation, a lease)."""
        return any(stamp(e) <= loss.signalled_wall for e in recoveries(log))

    def _bound(self, log: list[dict[str, Any]], loss: Loss) -> float:
        return SUSPECT_SECONDS if self._died_before(log, loss) else MOVED_SECONDS

    def _moves(self, accepted: list[Execution]) -> dict[str, list[float]]:
        """Signal → execution:recovered, by kind: a kill of a run's first owner to die,
        a kill of a later one (a suspect), a SIGTERM."""
        by_id = {e.execution_id: e for e in accepted}
        seconds: dict[str, list[float]] = {"kill": [], "suspect": [], "term": []}
        for loss in self.storm.losses:
            for execution_id in loss.owned:
                log = by_id[execution_id].log
                moved = [
                    stamp(e) - loss.signalled_wall
                    for e in recoveries(log)
                    if stamp(e) > loss.signalled_wall
                ]
                if not moved:
                    continue
                kind = loss.kind
                if kind == "kill" and self._died_before(log, loss):
                    kind = "suspect"
                seconds[kind].append(moved[0])
        return seconds

    # -- the queue's keys ------------------------------------------------------------

    def _leftovers(self) -> None:
        left = self.storm.leftovers
        if left is None:
            self.report.find("the queue's keys were not read (the load did not end)")
            return
        live = sum(slot.state == "up" for slot in self.storm.workers)
        for key, count in left.lines.items():
            self.report.find(f"{key}: {count} queued after every execution ended")
        if left.waiting:
            self.report.find(f"{left.waiting} tenants waiting after every execution ended")
        if left.taken:
            self.report.find(f"{left.taken} deliveries in taken after every execution ended")
        lease_ms = LEASE_SECONDS * 1000
        for key, members in left.running.items():
            live_entries = [
                (m, s)
                for m, s in members
                if not m.startswith("paused:") and s > left.now_ms + lease_ms
            ]
            if live_entries:
                self.report.find(f"{key}: running entries {live_entries[:3]} after all ended")
        consumers = sum(c for _, c, _, _ in left.streams.values())
        pending = sum(p for _, _, p, _ in left.streams.values())
        if consumers > live:
            self.report.find(f"{consumers} stream consumers, {live} live workers")
        if pending:
            self.report.find(f"{pending} pending stream entries after every execution ended")
        nodes = {slot.node for slot in self.storm.workers if slot.state == "up"}
        controls = [k for k in left.streams if ":{control}:" in k and k.rsplit(":", 1)[1] not in
                    ("handoffs", "queue")]  # fmt: skip
        dead = [k for k in controls if k.rsplit(":", 1)[1] not in nodes]
        kept = [k for k in dead if left.streams[k][3] < 0]
        if kept:
            self.report.find(
                f"{len(kept)} control streams of processes gone have no expiry "
                f"(one per process ever stopped), first {kept[0]}"
            )
        self.report.figures.update(
            left_running_entries=sum(len(m) for m in left.running.values()),
            left_streams={
                k.split(":", 2)[-1]: v[0] for k, v in left.streams.items() if k not in controls
            },
            control_streams=f"{len(controls)} ({len(dead)} of processes gone)",
            left_other=left.other[:5],
        )

    # -- figures and fairness --------------------------------------------------------

    def _figures(self, accepted: list[Execution]) -> None:
        storm, report = self.storm, self.report
        moves = Counter(e["data"]["reason"] for x in accepted for e in recoveries(x.log))
        seconds = self._moves(accepted)
        ends = Counter((x.log[-1]["type"].split(":")[1] if x.log else "none") for x in accepted)
        report.figures.update(
            heavy=sum(x.tenant == "heavy" for x in accepted),
            light=sum(x.tenant == "light" for x in accepted),
            ends=dict(ends),
            kills=sum(loss.kind == "kill" for loss in storm.losses),
            terms=sum(loss.kind == "term" for loss in storm.losses),
            lost_running=sum(len(loss.owned) for loss in storm.losses),
            most_slots_used=f"{storm.most_used:g} of {SLOTS}",
            load_average_max=round(storm.load_max, 1),
            # what, when (s into the load), (executions it owned / its slots in use)
            losses=" ".join(
                f"{loss.kind}@{loss.at:.1f}({len(loss.owned)}/{loss.used:g})"
                for loss in storm.losses[:12]
            )
            + (" …" if len(storm.losses) > 12 else ""),
            recoveries=moves["worker_lost"],
            handoffs=moves["handoff"],
            reconnects=sum(x.view.connections - 1 for x in accepted if x.view),
        )
        target = LEASE_SECONDS + 2.0  # issue 25: execution:recovered within lease + 2 s
        report.figures["recovered_past_lease_plus_2s"] = sum(t > target for t in seconds["kill"])
        for kind, name in (
            ("kill", "recovered"),
            ("suspect", "recovered_again"),
            ("term", "handed_off"),
        ):
            if seconds[kind]:
                report.figures[f"{name}_p50_s"] = round(statistics.median(seconds[kind]), 2)
                report.figures[f"{name}_max_s"] = round(max(seconds[kind]), 2)

    def _turnover(self, accepted: list[Execution], began: float, ended: float) -> float | None:
        """One slot's turnover over [began, ended] while the heavy line held work (the
        slots had work waiting): the slot-seconds the live workers had (each worker's
        slots while it was up) divided by the runs that took a slot meanwhile
        (``execution:started`` and ``execution:recovered``), so a slot lost with its
        worker counts for nothing (the bench's slots x window / executions, with the
        slots the run really had)."""
        live = sorted(self.storm.live)
        looks = [s for s in self.storm.samples if began <= s[0] <= ended]
        spans = [(a[0], b[0]) for a, b in pairwise(looks) if a[1] and b[1]]
        seconds = 0.0
        for low, high in spans:
            up = [n for at, n in live if at <= low]
            seconds += (high - low) * (up[-1] if up else 0) * SLOTS
        starts = sorted(
            stamp(event)
            for x in accepted
            for event in x.log
            if event["type"] in ("execution:started", RECOVERED_EVENT)
        )
        count = sum(bisect_right(starts, high) - bisect_right(starts, low) for low, high in spans)
        return seconds / count if count and seconds else None

    def _fairness(self, accepted: list[Execution]) -> None:
        storm, report = self.storm, self.report
        done = [x for x in accepted if x.log and x.log[-1]["type"] == "execution:completed"]
        holds = [stamp(x.log[-1]) - stamp(x.log[0]) for x in done if not recoveries(x.log)]
        half = storm.began_wall + storm.shape.window / 2
        turnover = self._turnover(accepted, storm.began_wall, half)
        if not holds or turnover is None:
            report.find("nothing started in phase A: no turnover measured")
            return
        # A start a worker took just before it was lost waits about a lease more (its
        # delivery is given back once the taker is presumed dead): held to that rule
        # instead, not to the fair share's.
        waits, across = [], []
        signals = [loss.signalled_wall for loss in storm.losses]

        looked = [wall for wall, _, _ in storm.samples]

        def heavy_waiting(at: float) -> bool:
            """The heavy line held work at the last look before ``at``."""
            index = bisect_right(looked, at) - 1
            return index >= 0 and storm.samples[index][1] > 0

        for x in done:
            if x.tenant != "light" or x.phase != "A":
                continue
            wait, started = x.log[0]["data"].get("queuedMs", 0) / 1000, stamp(x.log[0])
            if not heavy_waiting(started - wait):
                continue  # the heavy line had run dry (the load lagged): not measured
            lost = [at for at in signals if started - wait - 0.05 <= at <= started]
            if not lost:
                waits.append(wait)
                continue
            across.append(wait)
            if started - lost[0] > MOVED_SECONDS:
                report.find(
                    f"{x.execution_id}: queued across a worker loss, started "
                    f"{started - lost[0]:.1f} s after it (waited {wait:.2f} s)"
                )
        samples_a = [s for s in storm.samples if s[0] < half]
        heavy_backlogged = sum(h > 0 for _, h, _ in samples_a) / max(1, len(samples_a))
        p99 = percentile(waits, 99)
        report.figures.update(
            turnover_s=round(turnover, 3),
            hold_p50_s=round(statistics.median(holds), 3),
            light_wait_p50_s=round(percentile(waits, 50), 3),
            light_wait_p99_s=round(p99, 3),
            light_wait_p99_turnovers=round(p99 / turnover, 2),
            light_waits_across_losses=f"{len(across)}, max {max(across, default=0):.2f} s",
            heavy_backlogged_a=round(heavy_backlogged, 2),
        )
        if heavy_backlogged < 0.5:
            report.find(f"phase A: the heavy line was empty in {1 - heavy_backlogged:.0%} of looks")
        if not waits:
            report.find("phase A: no light execution completed")
        elif p99 > WAIT_TURNOVERS * turnover:
            report.find(
                f"phase A: the light tenant's wait p99 {p99:.3f} s is past {WAIT_TURNOVERS:g} "
                f"slot turnovers ({turnover:.3f} s each)"
            )
        # Phase B: the starts while both lines had work, by the looks around each.
        looks = [s for s in storm.samples if s[0] >= half]
        both = [(a[0], b[0]) for a, b in pairwise(looks) if a[1] and a[2] and b[1] and b[2]]
        starts: Counter[str] = Counter()
        for x in done:
            at = stamp(x.log[0])
            if any(low <= at <= high for low, high in both):
                starts[x.tenant] += 1
        share = starts["light"] / max(1, starts["heavy"])
        report.figures.update(
            share=round(share, 3),
            share_starts=f"{starts['light']}/{starts['heavy']}",
            both_backlogged_s=round(sum(high - low for low, high in both), 1),
        )
        low, high = SHARE_BOUNDS
        if not low <= share <= high:
            report.find(
                f"phase B: the light tenant's share of starts {share:.3f} "
                f"({starts['light']} vs {starts['heavy']}) is outside {low}-{high}"
            )
