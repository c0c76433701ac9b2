"""Only the owner loses Redis: its own link to Valkey is cut, the other replica keeps it.

Found by the step 15 fault review (F1). Replica A runs the execution through a TCP link
of its own to Valkey (tests/support/proxy.TcpLink); B talks to Valkey directly. Cutting
A's link resets its connections and refuses new ones, so A cannot tell this from an
outage for everyone, while B sees A's lease expire and takes the execution over. What
must hold (SPEC §4 "Ids", §5): A shows events live only under ids Redis reserved for it
and stops showing at once when a renewal fails, so no id a client of A saw is ever
stored as another event; a cancel through B ends the run above every such id; once the
link heals, every client of A gets the terminal event, and a reconnect with the last
id A showed gets it too (never a bare 204).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, put, until
from tests.support.faults import replica
from tests.support.logcheck import check_lossy_log, check_view, same_ids_same_events
from tests.support.proxy import TcpLink
from tests.support.servers import FlowcastServer, ValkeyServer
from tests.support.sse import Frame, events
from tests.support.timing import hold_for

pytestmark = pytest.mark.timeout(150)

TERMINAL = {"execution:completed", "execution:failed", "execution:cancelled"}
DEADLINE = 40.0


def burst_then_wait(workflow_id: str) -> dict[str, Any]:
    """talk (a fast stream of chunks: bursts) → wait (long) → end."""
    text = " ".join(f"w{i}" for i in range(3000))
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "talk", "type": "generate", "config": {"text": text, "tokensPerSecond": 1000}},
            {"id": "wait", "type": "delay", "config": {"ms": 60_000}},
            {"id": "end", "type": "transform", "config": {"value": 1}},
        ],
        "edges": [{"from": "talk", "to": "wait"}, {"from": "wait", "to": "end"}],
    }


class Follower:
    """A client following one execution on one replica as EventSource does: when the
    stream is cut it reconnects with ``Last-Event-ID``; it stops at the terminal event
    (or at a 204, which it records: the stream was over without a word)."""

    def __init__(self, server: FlowcastServer, execution_id: str) -> None:
        self.frames: list[Frame] = []
        self.got_204 = False
        self.done = asyncio.Event()
        self._client = httpx.AsyncClient(base_url=server.url, timeout=60)
        self._task = asyncio.create_task(self._follow(execution_id))

    def last_id(self) -> int:
        return max((int(frame.id) for frame in self.frames if frame.id is not None), default=0)

    def seen(self) -> list[dict[str, Any]]:
        return check_view(self.frames)

    async def _follow(self, execution_id: str) -> None:
        url = f"/api/executions/{execution_id}/stream"
        try:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    headers = {"Last-Event-ID": str(self.last_id())}
                    async with self._client.stream("GET", url, headers=headers) as response:
                        if response.status_code == 204:
                            self.got_204 = True
                            return
                        if response.status_code == 200:
                            async for frame in events(response):
                                self.frames.append(frame)
                                if frame.event in TERMINAL:
                                    return
                await hold_for(0.2, "EventSource's reconnection delay (a 503, or a cut)")
        finally:
            self.done.set()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()


async def stored(client: httpx.AsyncClient, execution_id: str) -> list[dict[str, Any]]:
    return await all_events(client, execution_id)


async def status_of(client: httpx.AsyncClient, execution_id: str) -> str:
    with contextlib.suppress(httpx.TransportError):
        response = await client.get(f"/api/executions/{execution_id}")
        if response.status_code == 200:
            return str(response.json()["status"])
    return ""


async def recovered_on(client: httpx.AsyncClient, execution_id: str) -> bool:
    with contextlib.suppress(httpx.TransportError, KeyError):
        return any(e["type"] == "execution:recovered" for e in await stored(client, execution_id))
    return False


def dropped_ranges(frames: list[Frame]) -> list[tuple[int, int]]:
    return [
        (frame.json["after"] + 1, frame.json["resumeAt"] - 1)
        for frame in frames
        if frame.event == "replay:gap"
    ]


@contextlib.asynccontextmanager
async def partitioned_pair(
    valkey: ValkeyServer, tmp_path: Path
) -> AsyncIterator[tuple[TcpLink, FlowcastServer, FlowcastServer]]:
    async with TcpLink(valkey.port) as link:
        a = replica(valkey, tmp_path, "a", FLOWCAST_REDIS_URL=link.url)
        b = replica(valkey, tmp_path, "b")
        try:
            await asyncio.gather(a.start(), b.start())
            yield link, a, b
        finally:
            await asyncio.gather(a.stop(signal.SIGKILL), b.stop(signal.SIGKILL))


async def test_an_owner_cut_off_from_redis_never_shows_an_id_the_next_owner_gives_again(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    """A streams a burst to two clients; its link to Valkey is cut mid-burst. B takes
    over and a cancel through B ends the run during the partition. No id either client
    saw is stored as another event; once the link heals both clients get the cancel,
    and a reconnect with the last id A showed gets it too, not 204."""
    async with (
        partitioned_pair(valkey, tmp_path) as (link, a, b),
        httpx.AsyncClient(base_url=a.url, timeout=30) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=30) as on_b,
    ):
        workflow = burst_then_wait(f"cut-{unique}")
        await put(on_a, workflow)
        response = await on_a.post(f"/api/workflows/{workflow['id']}/execute", json={})
        assert response.status_code == 202, response.text
        execution_id = response.json()["executionId"]
        followers = [Follower(a, execution_id), Follower(a, execution_id)]
        try:

            async def mid_burst() -> bool:
                return all(follower.last_id() >= 200 for follower in followers)

            await until(mid_burst, "both clients of A saw the burst")
            link.cut()
            stored_at_cut = len(await stored(on_b, execution_id))
            await until(lambda: recovered_on(on_b, execution_id), "B took the execution over")
            shown_by_a = [follower.last_id() for follower in followers]
            response = await on_b.post(f"/api/executions/{execution_id}/cancel")
            assert response.status_code in (200, 202), response.text

            async def cancelled() -> bool:
                return await status_of(on_b, execution_id) == "cancelled"

            await until(cancelled, "the cancel through B ended the run")
            # Nothing A showed after the cut came from ids Redis had not reserved for it.
            assert [follower.last_id() for follower in followers] == shown_by_a
            link.heal()

            async def ended() -> bool:
                return all(follower.done.is_set() for follower in followers)

            await until(ended, "every client of A got to the end once the link healed")
            log = await stored(on_b, execution_id)
            replay = await follow_to_end(on_b, execution_id, 0)
            check_lossy_log(log, dropped=dropped_ranges(replay))
            assert log[-1]["type"] == "execution:cancelled", log[-1]
            for follower in followers:
                assert not follower.got_204, "a client of A got 204 instead of the end"
                seen = follower.seen()
                same_ids_same_events(seen, log)
                assert seen[-1] == log[-1], (seen[-1], log[-1], stored_at_cut)
            # A reconnect with the last id A showed, on either replica: the end, not 204.
            for client in (on_a, on_b):
                for cursor in shown_by_a:
                    frames = await follow_to_end(client, execution_id, cursor)
                    assert frames, f"cursor {cursor} got 204 (terminal {log[-1]['id']})"
                    assert frames[-1].event == "execution:cancelled", frames[-1]
                    same_ids_same_events(check_view(frames, after=cursor), log)
        finally:
            for follower in followers:
                await follower.close()


async def follow_to_end(client: httpx.AsyncClient, execution_id: str, cursor: int) -> list[Frame]:
    """The frames of one stream from ``cursor`` to its end ([] for a 204)."""
    url = f"/api/executions/{execution_id}/stream"
    async with asyncio.timeout(DEADLINE):
        async with client.stream("GET", url, headers={"Last-Event-ID": str(cursor)}) as response:
            if response.status_code == 204:
                return []
            assert response.status_code == 200, await response.aread()
            return [frame async for frame in events(response)]


async def test_a_short_cut_closes_the_live_gate_and_the_stream_resumes_whole_once_it_heals(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    """A's link is cut for less than a lease: its renewal fails (the gate closes, the
    client is shown nothing more), then the link heals before anyone could take over.
    The next renewal opens the gate again: the client gets every event held back, in
    order, no gap, and the stored log is what it saw; nobody recovered the run."""
    lease = {"FLOWCAST_LEASE_SECONDS": "5"}
    async with TcpLink(valkey.port) as link:
        a = replica(valkey, tmp_path, "a", FLOWCAST_REDIS_URL=link.url, **lease)
        try:
            await a.start()
            async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a:
                text = " ".join(f"w{i}" for i in range(600))
                workflow = {
                    "id": f"short-{unique}",
                    "blocks": [
                        {
                            "id": "talk",
                            "type": "generate",
                            "config": {"text": text, "tokensPerSecond": 100},
                        }
                    ],
                    "edges": [],
                }
                await put(on_a, workflow)
                response = await on_a.post(f"/api/workflows/{workflow['id']}/execute", json={})
                assert response.status_code == 202, response.text
                execution_id = response.json()["executionId"]
                follower = Follower(a, execution_id)
                try:
                    await until(_async(lambda: follower.last_id() >= 20), "the client follows")
                    link.cut()
                    await until(
                        _async(lambda: "lease renewal failed" in a.logs()),
                        "A found it could not renew its lease",
                    )
                    shown_at_failure = follower.last_id()
                    link.heal()
                    await until(_async(follower.done.is_set), "the client got to the end")
                finally:
                    await follower.close()
                seen = follower.seen()
                log = await stored(on_a, execution_id)
        finally:
            await a.stop(signal.SIGKILL)
    assert not [frame for frame in follower.frames if frame.event == "replay:gap"]
    assert seen == log, "what the client saw is not what is stored"
    assert seen[-1]["type"] == "execution:completed"
    assert [e["id"] for e in seen] == list(range(1, len(seen) + 1))
    assert not [e for e in seen if e["type"] == "execution:recovered"]
    assert seen[-1]["id"] > shown_at_failure


def _async(check: Any) -> Any:
    async def wrapped() -> bool:
        return bool(check())

    return wrapped
