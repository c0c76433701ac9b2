"""Helpers for tests of the live list of executions (``GET /api/executions/live``): open
one, read it frame by frame (``Live``), or apply its frames to what a client shows
(``View``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from tests.support.sse import Frame, events

LIVE = "/api/executions/live"
FRAME_SECONDS = 15  # how long a test waits for the frame it expects


class Live:
    """One open live list, read frame by frame."""

    def __init__(self, response: httpx.Response, frame_seconds: float = FRAME_SECONDS) -> None:
        self.response = response
        self.frame_seconds = frame_seconds
        self._events = events(response)
        self.row: dict[str, Any] = {}  # the last row until() read

    async def next(self) -> Frame:
        async with asyncio.timeout(self.frame_seconds):
            return await anext(self._events)

    async def rows(self) -> list[dict[str, Any]]:
        """The next frame, which must be the whole list."""
        frame = await self.next()
        assert frame.event == "executions", frame
        assert frame.id is None
        rows: list[dict[str, Any]] = frame.json["executions"]
        return rows

    async def until(self, execution_id: str, status: str) -> list[str]:
        """Read this execution's frames until it shows ``status``; the statuses seen."""
        seen: list[str] = []
        while True:
            frame = await self.next()
            assert frame.event == "execution", frame
            assert frame.id is None
            self.row = frame.json
            assert self.row["id"] == execution_id, self.row
            seen.append(self.row["status"])
            if self.row["status"] == status:
                return seen

    async def rest(self) -> list[Frame]:
        """Every frame until the server ends the stream."""
        found: list[Frame] = []
        async with asyncio.timeout(self.frame_seconds):
            async for frame in self._events:
                found.append(frame)
        return found


@asynccontextmanager
async def live(
    client: httpx.AsyncClient, query: str = "", headers: dict[str, str] | None = None
) -> AsyncIterator[Live]:
    """An open live list (``query`` its filters), asserted to be one."""
    async with client.stream("GET", f"{LIVE}?{query}", headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        yield Live(response)


class View:
    """What a client of the live list shows, applying its frames as documented
    (app/routes/live.py): replace, insert or update (newest first by createdAt, at most
    ``limit``), drop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rows: list[dict[str, Any]] = []

    def apply(self, frame: Frame) -> None:
        if frame.event == "executions":
            self.rows = list(frame.json["executions"])
        elif frame.event == "execution":
            row = frame.json
            others = [shown for shown in self.rows if shown["id"] != row["id"]]
            others.append(row)
            others.sort(key=lambda shown: (shown["createdAt"], shown["id"]), reverse=True)
            self.rows = others[: self.limit]
        elif frame.event == "execution:unlisted":
            self.rows = [shown for shown in self.rows if shown["id"] != frame.json["id"]]
        else:
            raise AssertionError(f"unexpected frame {frame}")

    def shown(self) -> list[tuple[str, str]]:
        return [(row["id"], row["status"]) for row in self.rows]


@asynccontextmanager
async def live_frames(
    client: httpx.AsyncClient, query: str = ""
) -> AsyncIterator[AsyncIterator[Frame]]:
    """The event frames of an open live list."""
    async with client.stream("GET", f"{LIVE}?{query}") as response:
        if response.status_code != 200:
            await response.aread()
        assert response.status_code == 200, response.text
        yield events(response)


async def settles_on(
    frames: AsyncIterator[Frame], view: View, truth: list[tuple[str, str]], seconds: float
) -> list[tuple[str, str]]:
    """Apply frames until the view shows ``truth`` or ``seconds`` pass; what it shows."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while view.shown() != truth:
                view.apply(await anext(frames))
    return view.shown()
