"""A process's resident memory, read from ``/proc`` (Linux only)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path


def status_bytes(pid: int, field: str) -> int:
    """A ``kB`` line of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"/proc/{pid}/status has no {field}")


@dataclass
class Peak:
    """RSS before a run and the highest RSS seen during it."""

    before: int
    highest: int
    sampled: int = 0  # the highest VmRSS sample
    samples: int = 0
    hwm: int | None = None  # VmHWM at the end, if it could be reset at the start

    @property
    def growth(self) -> int:
        return self.highest - self.before


@contextlib.asynccontextmanager
async def peak_rss(pid: int, *, every: float = 0.05) -> AsyncIterator[Peak]:
    """Sample ``VmRSS`` every ``every`` seconds while the block runs.

    The kernel's own high-water mark, ``VmHWM``, is reset at the start (writing 5 to
    ``/proc/<pid>/clear_refs``, allowed for our own child) and read at the end, so a
    spike shorter than the sampling interval is not missed. Where the reset is refused,
    only the samples count: the mark would include the process's start.
    """
    before = status_bytes(pid, "VmRSS")
    peak = Peak(before=before, highest=before, sampled=before)
    reset = True
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        reset = False

    async def sample() -> None:
        while True:
            with contextlib.suppress(OSError, LookupError):  # the process may be gone
                peak.sampled = max(peak.sampled, status_bytes(pid, "VmRSS"))
                peak.samples += 1
            await asyncio.sleep(every)

    async with asyncio.TaskGroup() as group:
        sampler = group.create_task(sample())
        try:
            yield peak
        finally:
            sampler.cancel()
    if reset:
        with contextlib.suppress(OSError, LookupError):
            peak.hwm = status_bytes(pid, "VmHWM")
    peak.highest = max(peak.sampled, peak.hwm or 0)
