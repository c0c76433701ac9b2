"""The stream an ``execute`` opens (``Accept: text/event-stream``) on an execution that
was queued tells its place in line first, as ``GET .../stream`` does (SPEC §4
"Queued": "The stream of a queued execution opens at once. Until it starts, the server
sends ... event: queue ... when it opens"; issue 25: "or opens the stream at once with
event: queue frames, no ids").

Found by the step 17 fresh-eyes review: the execute's stream sent only heartbeats until
the execution started.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import put, quick_workflow
from tests.support.servers import FlowcastServer, ValkeyServer, env_on
from tests.support.sse import Frame, events

pytestmark = pytest.mark.timeout(60)


async def test_an_execute_that_queues_streams_its_place_in_line_then_its_log(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    env = env_on(valkey, sse_ping_seconds="0.2")
    api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
    worker = FlowcastServer(data_dir=tmp_path / "worker", env=env)
    await api.start()
    try:
        async with httpx.AsyncClient(base_url=api.url, timeout=30) as client:
            await put(client, quick_workflow("quick"))
            frames: list[Frame] = []
            first = asyncio.Event()
            url = "/api/workflows/quick/execute"
            headers = {"Accept": "text/event-stream"}

            async def stream() -> None:
                async with client.stream("POST", url, json={"input": {}}, headers=headers) as r:
                    assert r.status_code == 200
                    async for frame in events(r):
                        frames.append(frame)
                        first.set()

            task = asyncio.create_task(stream())
            # Nothing runs it yet (no process has a slot): its place comes all the same.
            await asyncio.wait_for(first.wait(), 10)
            assert frames[0].event == "queue" and frames[0].id is None, frames[0]
            assert frames[0].json == {"state": "queued", "ahead": 0}
            await worker.start()
            await asyncio.wait_for(task, 30)
            logged = [frame for frame in frames if frame.id is not None]
            assert [f.id for f in logged] == [str(n) for n in range(1, len(logged) + 1)]
            assert logged[0].event == "execution:started"
            assert logged[-1].event == "execution:completed"
    finally:
        await asyncio.gather(api.stop(), worker.stop())
