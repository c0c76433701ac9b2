"""How ``flowcast run`` and ``flowcast attach`` show an execution as it goes.

``PlainDisplay`` prints one stable line per event (for pipes, logs and scripts):

    <id> <type> [fields…]        e.g. ``4 block:completed story 1203ms``,
                                 ``6 execution:resumed review rejected: "too much" waited=5.02s``
    gap after=<n> resumeAt=<m> reason=<why>

and says on stderr where a queued execution stands (``flowcast: queued, 12 ahead``)
whenever that changes, until it starts.

``LiveDisplay`` (stdout is a terminal) is a ``rich`` live view redrawn in place: a header
(execution, workflow, status -- ``queued, 12 ahead`` while it waits, ``completed ·
rejected`` after a person said no -- and its duration from ``createdAt``, as every view
shows it) and one line per block with its status, duration (an approval: how long it
waited for a person, and the answer) and the tail of the text it streams; a block
that runs again (a retry, a re-run after ``execution:recovered``) shows only its latest
run's text. Notices (reconnects, gaps, recoveries) go to stderr in both, so stdout stays
the execution's own record.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TextIO

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.constrain import Constrain
from rich.live import Live
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from app.client import Event, Gap

REFRESH_PER_SECOND = 8
ECHO_ROOM = 3
TEXT_TAIL = 400
MARKS = {
    "running": "…",
    "retrying": "↻",
    "completed": "✓",
    "failed": "✗",
    "skipped": "-",
    "paused": "‖",
    "cancelled": "⊘",
}
STYLES = {
    "running": "yellow",
    "retrying": "yellow",
    "completed": "green",
    "failed": "red",
    "skipped": "dim",
    "paused": "magenta",
    "cancelled": "red",
    "queued": "cyan",
}


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def seconds(ms: Any) -> str:
    return f"{float(ms) / 1000:.2f}s" if isinstance(ms, int | float) else "?"


def event_ms(event: Event) -> float | None:
    """The event's ``ts`` in ms since the epoch (None if it has none that parses)."""
    ts = event.envelope.get("ts")
    if not isinstance(ts, str):
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1000
    except ValueError:
        return None


def created_ms(created_at: str | None) -> float | None:
    """An execution's ``createdAt`` in ms since the epoch (None if absent or unreadable)."""
    if not created_at:
        return None
    try:
        return datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp() * 1000
    except ValueError:
        return None


def decision(answer: Any) -> str:
    """What a pause's answer (``execution:resumed``'s ``input``) decided: ``approved`` or
    ``rejected`` for an answer with a boolean ``approved`` (the approval schema's
    convention, SPEC §2), with its ``note`` when it gave one; ``answered`` otherwise."""
    given = answer if isinstance(answer, dict) else {}
    approved = given.get("approved")
    said = "approved" if approved is True else "rejected" if approved is False else "answered"
    note = given.get("note")
    return f"{said}: {compact(note)}" if isinstance(note, str) and note else said


class Display(Protocol):
    def started(
        self, execution_id: str, workflow_id: str, created_at: str | None = None
    ) -> None: ...
    def event(self, event: Event) -> None: ...
    def gap(self, gap: Gap) -> None: ...
    def queued(self, ahead: int) -> None: ...
    def notice(self, text: str) -> None: ...
    def close(self) -> None: ...


def queued_text(ahead: int) -> str:
    """A queued execution's place: ``queued, 12 ahead``."""
    return f"queued, {ahead} ahead"


def gap_notice(gap: Gap) -> str:
    return (
        f"events {gap.after + 1}-{gap.resume_at - 1} are no longer retained ({gap.reason}); "
        f"continuing at {gap.resume_at}"
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def recovery_notice(data: dict[str, Any]) -> str:
    """A recovery in words: ``recovered (worker_lost), 2 blocks re-run, 1 kept``."""
    rerun, kept = data.get("rerun") or [], data.get("completed") or []
    return (
        f"recovered ({data.get('reason')}), {_count(len(rerun), 'block')} re-run, "
        f"{len(kept)} kept from the checkpoint"
    )


def describe(event: Event) -> str:
    """The fields of one event, as the plain display prints them after id and type."""
    data = event.data
    block = data.get("blockId", "")
    match event.type:
        case "block:started":
            return f"{block} type={data.get('blockType')} attempt={data.get('attempt')}"
        case "block:chunk":
            return f"{block} {compact(data.get('text', ''))}"
        case "block:completed":
            return f"{block} {data.get('durationMs')}ms"
        case "block:failed":
            error = data.get("error") or {}
            retry = "yes" if data.get("willRetry") else "no"
            return (
                f"{block} attempt={data.get('attempt')} retry={retry} "
                f"{error.get('code')}: {compact(error.get('message'))}"
            )
        case "block:skipped":
            return f"{block} {compact(data.get('reason'))}"
        case "execution:paused":
            return f"{block} {compact(data.get('prompt'))}"
        case "execution:resumed":
            return f"{block} {decision(data.get('input'))}"
        case "execution:recovered":
            rerun = ",".join(data.get("rerun") or []) or "-"
            kept = ",".join(data.get("completed") or []) or "-"
            return (
                f"{data.get('reason')} recovery={data.get('recovery')} "
                f"rerun={rerun} completed={kept}"
            )
        case "execution:completed":
            return f"{data.get('durationMs')}ms"
        case "execution:failed":
            error = data.get("error") or {}
            return f"{error.get('code')}: {compact(error.get('message'))}"
        case "execution:cancelled":
            return compact(data.get("reason"))
    return ""


class PlainDisplay:
    """One line per event on ``out``; stable, for machines."""

    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.out, self.err = out, err
        self._ahead: int | None = None  # the place last said, while queued
        self._paused: dict[str, float] = {}  # blockId -> when it paused (ms), until answered

    def started(self, execution_id: str, workflow_id: str, created_at: str | None = None) -> None:
        print(f"execution {execution_id} workflow={workflow_id}", file=self.out, flush=True)

    def event(self, event: Event) -> None:
        line = f"{event.id} {event.type} {describe(event)}".rstrip()
        block, at = str(event.data.get("blockId", "")), event_ms(event)
        if event.type == "execution:paused" and at is not None:
            self._paused[block] = at
        elif event.type == "execution:resumed" and at is not None and block in self._paused:
            # How long the person took: ``5 execution:resumed review approved waited=5.02s``.
            line += f" waited={seconds(max(0.0, at - self._paused.pop(block)))}"
        print(line, file=self.out, flush=True)
        if event.type == "execution:recovered":
            self.notice(recovery_notice(event.data))

    def gap(self, gap: Gap) -> None:
        line = f"gap after={gap.after} resumeAt={gap.resume_at} reason={gap.reason}"
        print(line, file=self.out, flush=True)
        self.notice(gap_notice(gap))

    def queued(self, ahead: int) -> None:
        if ahead != self._ahead:
            self._ahead = ahead
            self.notice(queued_text(ahead))

    def notice(self, text: str) -> None:
        print(f"flowcast: {text}", file=self.err, flush=True)

    def close(self) -> None:
        return None


@dataclass
class _Block:
    """One block as the live view shows it; times are ms since the epoch, from the
    events' own ``ts`` (so a replayed run shows what happened, not when it was read)."""

    type: str = "?"
    status: str = "running"
    detail: str = ""
    began: float = 0.0
    ended: float | None = None
    duration_ms: float | None = None
    text: str = ""
    paused_at: float | None = None  # when it paused for a person
    waited_ms: float | None = None  # how long a person took to answer (or until the end)

    def run(self, now: float, detail: str) -> None:
        """A (new) run of the block: its own clock, and its text afresh."""
        self.status, self.detail, self.began, self.ended = "running", detail, now, None
        # A block that runs again (a retry, a re-run after a recovery) streams its text
        # again from the start: show this run's text, not both runs' joined.
        self.text = ""


class _Tail:
    """The end of a block's streamed text, cut at the front to the width it is given."""

    def __init__(self, prefix: str, text: str, style: str = "") -> None:
        self.prefix, self.text, self.style = prefix, text, style

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, max(1, len(self.prefix) + len(self.text)))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = max(1, options.max_width - len(self.prefix))
        text = self.text if len(self.text) <= room else "…" + self.text[-(room - 1) :]
        yield Text.assemble((self.prefix, "dim"), (text, self.style), no_wrap=True, end="")


def _same_terminal(out: TextIO, err: TextIO) -> bool:
    try:
        return (
            out.isatty()
            and err.isatty()
            and os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno()))
        )
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return False


class LiveDisplay:
    """The execution as a live view on a terminal, one line per block (``rich.live``)."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.console = Console(file=self.out, highlight=False)
        self.header = ""
        self.status = "running"
        self.ahead: int | None = None  # while queued: about how many start first
        # The run's creation and end, ms since the epoch: its duration is one for every
        # view, createdAt to the terminal event (SPEC §9), whenever it is watched.
        self.created: float | None = None
        self.ended: float | None = None
        self._guessed = False  # ``created`` is when the view opened, not known yet
        self.rejected = False  # a person answered an approval with approved false
        self.blocks: dict[str, _Block] = {}
        # Events arrive on this thread while rich redraws from its own: the view is
        # built from the state under this lock.
        self._lock = threading.Lock()
        # When stderr is the same terminal, notices (and any stray stderr line) are
        # printed through the live console, which redraws the view below them; written
        # straight to stderr they would land inside the view. A redirected stderr
        # (``2>file``) gets them as they are.
        self._notices_on_console = _same_terminal(self.out, self.err)
        self._live = Live(
            console=self.console,
            get_renderable=self.view,
            refresh_per_second=REFRESH_PER_SECOND,
            redirect_stdout=False,
            redirect_stderr=self._notices_on_console,
        )

    def started(self, execution_id: str, workflow_id: str, created_at: str | None = None) -> None:
        with self._lock:
            self.header = f"{execution_id}  {workflow_id}"
            self.created = created_ms(created_at)
            # Not given (``run`` has only just started it): now, until its first event
            # says when it was created.
            self._guessed = self.created is None
            if self.created is None:
                self.created = time.time() * 1000
        self._live.start(refresh=True)

    def event(self, event: Event) -> None:
        with self._lock:
            at = event_ms(event)
            self._apply(event, at if at is not None else time.time() * 1000)
        if event.type == "execution:recovered":
            self.notice(recovery_notice(event.data))
        if event.type != "block:chunk":  # chunks wait for the next periodic redraw
            self._live.refresh()

    def _apply(self, event: Event, now: float) -> None:
        data = event.data
        block_id = str(data.get("blockId", ""))
        block = self.blocks.setdefault(block_id, _Block()) if block_id else None
        if block is not None and event.type == "block:started":
            attempt = data.get("attempt", 1)
            block.type = str(data.get("blockType"))
            block.run(now, f"attempt {attempt}" if isinstance(attempt, int) and attempt > 1 else "")
        elif block is not None and event.type == "block:chunk":
            block.text = (block.text + str(data.get("text", "")))[-TEXT_TAIL:]
        elif block is not None and event.type == "block:completed":
            block.status, block.ended = "completed", now
            duration = data.get("durationMs")
            block.duration_ms = float(duration) if isinstance(duration, int | float) else None
        elif block is not None and event.type == "block:failed":
            error = data.get("error") or {}
            block.status = "retrying" if data.get("willRetry") else "failed"
            block.ended = now
            block.detail = f"{error.get('code')}: {error.get('message')}"
        elif block is not None and event.type == "block:skipped":
            block.status, block.detail = "skipped", str(data.get("reason", ""))
        elif block is not None and event.type == "execution:paused":
            block.status, block.detail = "paused", str(data.get("prompt", ""))
            block.paused_at, block.waited_ms = now, None
            self.status = "paused"
        elif block is not None and event.type == "execution:resumed":
            # The person's answer: how long it took them, and what they said.
            said = decision(data.get("input"))
            self.rejected = self.rejected or said.startswith("rejected")
            if block.paused_at is not None:
                block.waited_ms = max(0.0, now - block.paused_at)
            block.status, block.detail = "running", said
            self.status, self.ahead = "running", None
        elif event.type == "execution:started":
            self.status, self.ahead = "running", None
            if self.created is None or self._guessed:  # a snapshot's createdAt is exact
                self._guessed = False
                queued = data.get("queuedMs")
                self.created = now - (queued if isinstance(queued, int | float) else 0)
        elif event.type == "execution:recovered":
            # Not an ending: the execution goes on under a new owner.
            self.status = "running"
            for rerun in data.get("rerun") or []:
                self.blocks.setdefault(str(rerun), _Block()).run(now, "re-run")
        elif event.terminal_status:
            self.status, self.ended = event.terminal_status, now
            if event.terminal_status != "completed":
                self._stop_blocks(now)

    def _stop_blocks(self, now: float) -> None:
        """The run ended failed or cancelled: blocks still under way were stopped with
        it (no event of their own says so), as the page shows them too."""
        for block in self.blocks.values():
            if block.status not in ("running", "retrying", "paused"):
                continue
            if block.paused_at is not None and block.waited_ms is None:
                block.waited_ms = max(0.0, now - block.paused_at)
                block.detail = "no answer"
            block.status, block.ended = "cancelled", now

    def gap(self, gap: Gap) -> None:
        self.notice(gap_notice(gap))

    def queued(self, ahead: int) -> None:
        with self._lock:
            # Before it starts, or a resume that waits in line (after its pause).
            if self.status in ("running", "queued", "paused"):
                self.status, self.ahead = "queued", ahead
        self._live.refresh()

    def notice(self, text: str) -> None:
        if self._notices_on_console and self._live.is_started:
            self.console.print(Text(f"flowcast: {text}", style="yellow"))
        else:
            print(f"flowcast: {text}", file=self.err, flush=True)

    def close(self) -> None:
        """Draw the view a last time and leave it on the screen (idempotent)."""
        self._live.stop()

    def view(self) -> RenderableType:
        """What the terminal shows now: the header, then one row per block."""
        with self._lock:
            now = time.time() * 1000
            took = ""
            if self.created is not None:
                took = f"  {max(0.0, (self.ended or now) - self.created) / 1000:.1f}s"
            status, style = self.status, STYLES.get(self.status, "")
            if status == "queued" and self.ahead is not None:
                status = queued_text(self.ahead)
            if status == "completed" and self.rejected:
                status, style = "completed · rejected", "red"
            header = Text.assemble((self.header, "bold"), "  ", (status, style), took)
            rows = Table.grid(padding=(0, 1))
            for _ in range(5):
                rows.add_column(no_wrap=True)
            rows.add_column()  # the note: what the block says or streams, cut to fit
            for name, block in self.blocks.items():
                style = STYLES.get(block.status, "")
                rows.add_row(
                    Text(MARKS.get(block.status, "?"), style=style),
                    Text(name, style="bold"),
                    Text(block.type, style="dim"),
                    Text(block.status, style=style),
                    _took(block, now),
                    _note(block),
                )
        # Rows are padded to the widest one, and the terminal echoes Ctrl-C as "^C" after
        # the last: kept three columns short of the edge, that echo never wraps, so the
        # last redraw starts where the view is instead of a line lower.
        width = max(20, self.console.width - ECHO_ROOM)
        return Constrain(Group(header, Padding(rows, (0, 0, 0, 2))), width=width)


def _took(block: _Block, now: float) -> str:
    """A finished block's duration (the server's, when it gave one), a running one's
    time; a block that paused, how long it waited for a person (times in ms)."""
    if block.waited_ms is not None:
        return f"waited {block.waited_ms / 1000:.1f}s"
    if block.status == "paused" and block.paused_at is not None:
        return f"waiting {max(0.0, now - block.paused_at) / 1000:.0f}s"
    if block.status == "completed" and block.duration_ms is not None:
        return seconds(block.duration_ms)
    if block.status in ("running", "retrying"):
        return f"{max(0.0, now - block.began) / 1000:.1f}s"
    if block.ended is not None:
        return seconds(block.ended - block.began)
    return ""


def _note(block: _Block) -> _Tail:
    text = " ".join(block.text.split())
    if block.status in ("failed", "retrying"):
        return _Tail("", block.detail, "red" if block.status == "failed" else "yellow")
    if block.status in ("skipped", "paused", "cancelled"):
        return _Tail("", block.detail)
    if block.detail.startswith("rejected"):
        return _Tail("", block.detail, "red")
    prefix = f"{block.detail} · " if block.detail and text else block.detail
    return _Tail(prefix, text)
