"""How ``flowcast run`` and ``flowcast attach`` show an execution as it goes.

``PlainDisplay`` prints one stable line per event (for pipes, logs and scripts):

    <id> <type> [fields…]        e.g. ``4 block:completed story 1203ms``
    gap after=<n> resumeAt=<m> reason=<why>

``LiveDisplay`` (stdout is a terminal) redraws a compact block: one line per block with
its status and duration, and the tail of the text a block is streaming; a block that
runs again (a retry, a re-run after ``execution:recovered``) shows only its latest run's
text. Notices (reconnects, gaps, recoveries) go to stderr in both, so stdout stays the
execution's own record.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from app.client import Event, Gap

REDRAW_SECONDS = 0.05
TEXT_TAIL = 400
MARKS = {"running": "…", "completed": "✓", "failed": "✗", "skipped": "-", "paused": "‖"}


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def seconds(ms: Any) -> str:
    return f"{float(ms) / 1000:.2f}s" if isinstance(ms, int | float) else "?"


class Display(Protocol):
    def started(self, execution_id: str, workflow_id: str) -> None: ...
    def event(self, event: Event) -> None: ...
    def gap(self, gap: Gap) -> None: ...
    def notice(self, text: str) -> None: ...
    def close(self) -> None: ...


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
            return str(block)
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

    def started(self, execution_id: str, workflow_id: str) -> None:
        print(f"execution {execution_id} workflow={workflow_id}", file=self.out, flush=True)

    def event(self, event: Event) -> None:
        print(f"{event.id} {event.type} {describe(event)}".rstrip(), file=self.out, flush=True)
        if event.type == "execution:recovered":
            self.notice(recovery_notice(event.data))

    def gap(self, gap: Gap) -> None:
        line = f"gap after={gap.after} resumeAt={gap.resume_at} reason={gap.reason}"
        print(line, file=self.out, flush=True)
        self.notice(gap_notice(gap))

    def notice(self, text: str) -> None:
        print(f"flowcast: {text}", file=self.err, flush=True)

    def close(self) -> None:
        return None


@dataclass
class _Block:
    type: str = "?"
    status: str = "running"
    detail: str = ""
    began: float = 0.0
    text: str = ""


class LiveDisplay:
    """A status block redrawn in place on a terminal."""

    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.out, self.err = out, err
        self.header = ""
        self.status = "running"
        self.began = time.monotonic()
        self.blocks: dict[str, _Block] = {}
        self.streaming: str | None = None
        self._drawn = 0
        self._last_draw = 0.0

    def started(self, execution_id: str, workflow_id: str) -> None:
        self.header = f"{execution_id}  {workflow_id}"
        self._draw(force=True)

    def event(self, event: Event) -> None:
        data = event.data
        block_id = str(data.get("blockId", ""))
        block = self.blocks.setdefault(block_id, _Block()) if block_id else None
        now = time.monotonic()
        if block is not None and event.type == "block:started":
            block.type, block.status, block.began = str(data.get("blockType")), "running", now
            block.detail = f"attempt {data.get('attempt')}" if data.get("attempt", 1) > 1 else ""
            # A block that runs again (a retry, a re-run after a recovery) streams its
            # text again from the start: show this run's text, not both runs' joined.
            block.text = ""
        elif block is not None and event.type == "block:chunk":
            block.text = (block.text + str(data.get("text", "")))[-TEXT_TAIL:]
            self.streaming = block_id
        elif block is not None and event.type == "block:completed":
            block.status, block.detail = "completed", seconds(data.get("durationMs"))
        elif block is not None and event.type == "block:failed":
            error = data.get("error") or {}
            block.status = "running" if data.get("willRetry") else "failed"
            block.detail = f"{error.get('code')}: {error.get('message')}"
        elif block is not None and event.type == "block:skipped":
            block.status, block.detail = "skipped", str(data.get("reason", ""))
        elif block is not None and event.type == "execution:paused":
            block.status, block.detail = "paused", str(data.get("prompt", ""))
            self.status = "paused"
        elif event.type == "execution:resumed":
            self.status = "running"
        elif event.type == "execution:recovered":
            # Not an ending: the execution goes on under a new owner.
            self.status = "running"
            self.notice(recovery_notice(data))
            for rerun in data.get("rerun") or []:
                again = self.blocks.setdefault(str(rerun), _Block())
                again.status, again.detail, again.began = "running", "re-run", now
        elif event.terminal_status:
            self.status = event.terminal_status
        self._draw(force=event.type != "block:chunk")

    def gap(self, gap: Gap) -> None:
        self.notice(gap_notice(gap))

    def notice(self, text: str) -> None:
        self._clear()
        print(f"flowcast: {text}", file=self.err, flush=True)
        self._draw(force=True)

    def close(self) -> None:
        self._draw(force=True)

    def _lines(self) -> list[str]:
        now = time.monotonic()
        lines = [f"{self.header}  {self.status}  {now - self.began:.1f}s"]
        for name, block in self.blocks.items():
            detail = block.detail
            if block.status == "running" and not detail:
                detail = f"{now - block.began:.1f}s"
            mark = MARKS.get(block.status, "?")
            lines.append(f"  {mark} {name:<16} {block.type:<10} {block.status:<10} {detail}")
        streaming = self.blocks.get(self.streaming or "")
        if streaming is not None and streaming.text:
            lines.append("    " + " ".join(streaming.text.split()))
        return lines

    def _clear(self) -> None:
        if self._drawn:
            # Up to the first line of the block, then erase to the end of the screen.
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < REDRAW_SECONDS:
            return
        self._last_draw = now
        width = max(20, shutil.get_terminal_size().columns - 1)
        self._clear()
        lines = self._lines()
        for line in lines:
            # Lines are cut to the width so none wraps and the count stays right.
            text = line[-width:] if line.startswith("    ") else line[:width]
            self.out.write(text + "\n")
        self.out.flush()
        self._drawn = len(lines)
