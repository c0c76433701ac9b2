"""Step 14 review: attempts to break what changed (the live list of executions and its
status messages from start.lua/append.lua, list tokens, nginx in front of the replicas,
/metrics behind a key, the CLI's client, the embedded engine in its own session), with
real processes. Each test is named for the behaviour it holds the code to."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app.embedded import free_port
from tests.support.api import put, wait_finished
from tests.support.servers import ROOT, FlowcastServer, ValkeyServer
from tests.support.sse import Frame, events
from tests.support.sse import frames as sse_frames

LIVE = "/api/executions/live"
FRAME_SECONDS = 10


def approval_workflow(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": {}}},
            {"id": "done", "type": "transform", "config": {"value": 1}},
        ],
        "edges": [{"from": "review", "to": "done"}],
    }


async def execute(client: httpx.AsyncClient, workflow_id: str) -> str:
    response = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
    assert response.status_code == 202, response.text
    execution_id: str = response.json()["executionId"]
    return execution_id


async def until_status(client: httpx.AsyncClient, execution_id: str, status: str) -> None:
    async with asyncio.timeout(20):
        while (await client.get(f"/api/executions/{execution_id}")).json()["status"] != status:
            await asyncio.sleep(0.02)


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


# ---------------------------------------------------------------- the live list


@pytest.mark.timeout(60)
async def test_a_full_status_filtered_live_list_shows_the_next_match_when_a_row_leaves_it(
    client: httpx.AsyncClient, unique: str
) -> None:
    # Two paused executions, a live list of the paused ones with room for one: it shows
    # the newer. Once that one is cancelled the older is the paused one a reload shows,
    # and the live list must show it too (SPEC §9: the list is live, filters included),
    # not an empty list until something else happens to change.
    workflow_id = f"full-{unique}"
    await put(client, approval_workflow(workflow_id))
    older = await execute(client, workflow_id)
    await until_status(client, older, "paused")
    newer = await execute(client, workflow_id)
    await until_status(client, newer, "paused")

    query = f"workflowId={workflow_id}&status=paused&limit=1"
    view = View(limit=1)
    async with live_frames(client, query) as frames:
        view.apply(await anext(frames))
        assert view.shown() == [(newer, "paused")]
        cancelled = await client.post(f"/api/executions/{newer}/cancel")
        assert cancelled.status_code == 202, cancelled.text
        await wait_finished(client, newer)
        listed = (await client.get(f"/api/executions?{query}")).json()["executions"]
        truth = [(row["id"], row["status"]) for row in listed]
        assert truth == [(older, "paused")]
        assert await settles_on(frames, view, truth, FRAME_SECONDS) == truth


# ---------------------------------------------------------------- the status messages


def delay_then_done(workflow_id: str, ms: int) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "wait", "type": "delay", "config": {"ms": ms}}],
        "edges": [],
    }


@pytest.mark.timeout(90)
async def test_a_status_message_redis_will_not_publish_never_fails_a_write_that_took_effect(
    own_valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # The list's PUBLISH comes after start.lua's and append.lua's writes, and a script
    # that fails halfway keeps what it wrote. Here Redis refuses that one PUBLISH (an
    # ACL that predates the status channel: the notify channel only), so the start of
    # an execution fails after creating it. The caller must not get an error for an
    # execution that then runs anyway (the janitor takes the orphan over, SPEC §7): a
    # best-effort message must never decide a write's outcome.
    admin = Redis.from_url(own_valkey.url)
    try:
        await admin.execute_command(
            "ACL", "SETUSER", "flowcast", "on", ">pw", "~*", "&*", "+@all", "-publish",
            "(+publish ~* &fc:notify)",
        )  # fmt: skip
    finally:
        await admin.aclose()
    url = f"redis://flowcast:pw@127.0.0.1:{own_valkey.port}/0"
    server = FlowcastServer(
        data_dir=tmp_path / "server",
        env={"FLOWCAST_REDIS_URL": url, "FLOWCAST_LEASE_SECONDS": "1"},
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            workflow_id = f"acl-{unique}"
            await put(client, delay_then_done(workflow_id, 200))
            answer = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": {}})
            listed = await client.get(f"/api/executions?workflowId={workflow_id}")
            runs = listed.json()["executions"]
            # Either it was accepted, or nothing of it exists.
            assert answer.status_code == 202 or runs == [], (answer.status_code, answer.text, runs)
            assert answer.status_code == 202, answer.text
            execution_id = answer.json()["executionId"]
            async with asyncio.timeout(20):
                snapshot = await wait_finished(client, execution_id)
            assert snapshot["status"] == "completed", snapshot
    finally:
        await server.stop()


# ---------------------------------------------------------------- a 202, then the replica dies


async def _accepted_then_died(
    valkey: ValkeyServer,
    prefix: str,
    execution_id: str,
    mode: str,
    block_id: str = "",
    answer: bytes = b"",
) -> None:
    """What Redis holds once a replica has answered 202 to a resume or a cancel of a
    paused execution and died before writing anything more (SIGKILL, OOM, a lost
    machine, between the claim and the next write): its lease watched, its claim won
    (exactly the calls Runner._claim makes before the 202)."""
    from lib.execution.buffer import EventBuffer
    from lib.execution.ownership import Ownership

    redis = Redis.from_url(valkey.url)
    try:
        ownership = Ownership(buffer=EventBuffer(redis=redis, prefix=prefix), lease_seconds=1)
        fence = ownership.new_fence("deadnode")
        await ownership.hold(execution_id, fence)
        claim = await ownership.claim(execution_id, mode, fence, block_id=block_id, answer=answer)
        assert claim.status_before == "paused", claim
    finally:
        await redis.aclose()


@asynccontextmanager
async def lone_replica(valkey: ValkeyServer, root: Path) -> AsyncIterator[tuple[str, str]]:
    """A replica with a 1 s lease on a prefix of its own: (its url, the prefix)."""
    prefix = f"b14{uuid.uuid4().hex[:6]}"
    server = FlowcastServer(
        data_dir=root,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": prefix,
            "FLOWCAST_LEASE_SECONDS": "1",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    try:
        yield server.url, prefix
    finally:
        await server.stop()


async def _types(client: httpx.AsyncClient, execution_id: str) -> list[str]:
    page = (await client.get(f"/api/executions/{execution_id}/events?after=0")).json()
    return [event["type"] for event in page["events"]]


async def _settled(client: httpx.AsyncClient, execution_id: str, seconds: float) -> dict[str, Any]:
    """The snapshot once finished or paused again after a recovery (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        snapshot: dict[str, Any] = (await client.get(f"/api/executions/{execution_id}")).json()
        finished = snapshot["status"] in ("completed", "failed", "cancelled")
        repaused = snapshot["status"] == "paused" and "execution:recovered" in await _types(
            client, execution_id
        )
        if finished or repaused or time.monotonic() > deadline:
            return snapshot
        await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_a_cancel_accepted_by_a_replica_that_dies_at_once_still_cancels_the_pause(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # SPEC §3: a 202 to a cancel means it will happen, whatever races with it, another
    # replica taking the execution over included. The claim that moved the pause to
    # the canceller cleared cancelRequested, so the replica that recovers it has no
    # record of the cancel and runs the approval again: paused, waiting for a human.
    async with lone_replica(valkey, tmp_path) as (url, prefix):
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            workflow_id = f"cx-{unique}"
            await put(client, approval_workflow(workflow_id))
            execution_id = await execute(client, workflow_id)
            await until_status(client, execution_id, "paused")
            await _accepted_then_died(valkey, prefix, execution_id, "cancel")
            snapshot = await _settled(client, execution_id, 20)
            types = await _types(client, execution_id)
    assert snapshot["status"] == "cancelled", (snapshot["status"], types)


@pytest.mark.timeout(60)
async def test_a_resume_accepted_by_a_replica_that_dies_at_once_still_takes_its_answer(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # The same for a resume. The answer lived only in the dead replica's memory until
    # its execution:resumed event was stored, so the replica that recovered the
    # execution ran the approval again and paused, asking the question the 202 had
    # answered. The claim now checkpoints the answer (claim.lua, `a:<block>`).
    async with lone_replica(valkey, tmp_path) as (url, prefix):
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            workflow_id = f"rx-{unique}"
            await put(client, approval_workflow(workflow_id))
            execution_id = await execute(client, workflow_id)
            await until_status(client, execution_id, "paused")
            await _accepted_then_died(
                valkey, prefix, execution_id, "resume", "review", b'{"approved": true}'
            )
            snapshot = await _settled(client, execution_id, 20)
            types = await _types(client, execution_id)
            events = (await client.get(f"/api/executions/{execution_id}/events")).json()
    assert snapshot["status"] == "completed", (snapshot["status"], types)
    assert "execution:paused" not in types[types.index("execution:recovered") :], types
    review = [
        e["data"]["output"]
        for e in events["events"]
        if e["type"] == "block:completed" and e["data"]["blockId"] == "review"
    ]
    assert review == [{"approved": True}], review


@pytest.mark.timeout(60)
async def test_a_resume_answered_202_by_a_replica_sigkilled_right_after_takes_effect(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # The same with real processes: A answers the resume 202 and is SIGKILLed while it
    # keeps the answer (a large answer goes to the value store first; A's store fails
    # here, which only stretches the moment between the 202 and the resumed event).
    prefix = f"b14{uuid.uuid4().hex[:6]}"
    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": prefix,
        "FLOWCAST_LEASE_SECONDS": "1",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        "FLOWCAST_LARGE_VALUE_BYTES": "1024",
    }
    a = FlowcastServer(data_dir=tmp_path / "a", env=env)
    b = FlowcastServer(data_dir=tmp_path / "b", env=env)
    await asyncio.gather(a.start(), b.start())
    try:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
        ):
            workflow_id = f"rk-{unique}"
            await put(on_a, approval_workflow(workflow_id))
            execution_id = await execute(on_a, workflow_id)
            await until_status(on_a, execution_id, "paused")
            (a.data_dir / "values" / execution_id).write_text("not a directory")
            answer = {"note": "x" * 4096}
            resumed = await on_a.post(
                f"/api/executions/{execution_id}/resume", json={"input": answer}
            )
            os.kill(a.pid, signal.SIGKILL)
            assert resumed.status_code == 202, resumed.text
            snapshot = await _settled(on_b, execution_id, 20)
            types = await _types(on_b, execution_id)
    finally:
        await asyncio.gather(a.stop(signal.SIGKILL), b.stop())
    assert snapshot["status"] == "completed", (snapshot["status"], types)


# ---------------------------------------------------------------- nginx, the CLI, a SIGKILL

PROXY_KEY = "break14-key-" + "k" * 20
PROXY_AUTH = {"Authorization": f"Bearer {PROXY_KEY}"}


def talking(workflow_id: str, *, words: int, tps: float) -> dict[str, Any]:
    text = " ".join(f"w{i}" for i in range(words))
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "talk", "type": "generate", "config": {"text": text, "tokensPerSecond": tps}}
        ],
        "edges": [],
    }


async def _sse_clients(url: str) -> float:
    async with httpx.AsyncClient(base_url=url, headers=PROXY_AUTH, timeout=10) as client:
        for line in (await client.get("/metrics")).text.splitlines():
            if line.startswith("flowcast_sse_clients "):
                return float(line.split()[1])
    raise AssertionError("no flowcast_sse_clients in /metrics")


@asynccontextmanager
async def proxied_pair(
    valkey: ValkeyServer, root: Path
) -> AsyncIterator[tuple[tuple[FlowcastServer, FlowcastServer], Any]]:
    from tests.support.proxy import NginxProxy

    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": f"b14p{uuid.uuid4().hex[:6]}",
        "FLOWCAST_API_KEYS": PROXY_KEY,
        "FLOWCAST_SECRET_KEY": "break14-secret-" + "s" * 20,
        "FLOWCAST_LEASE_SECONDS": "1",
        "FLOWCAST_SSE_PING_SECONDS": "0.5",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    pair = (
        FlowcastServer(data_dir=root / "a", env=env),
        FlowcastServer(data_dir=root / "b", env=env),
    )
    await asyncio.gather(*(server.start() for server in pair))
    try:
        addresses = (f"127.0.0.1:{pair[0].port}", f"127.0.0.1:{pair[1].port}")
        async with NginxProxy(directory=root / "nginx", replicas=addresses) as nginx:
            yield pair, nginx
    finally:
        await asyncio.gather(*(server.stop(signal.SIGKILL) for server in pair))


def _parse_plain(lines: list[str]) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """The CLI's --plain lines: (id, type) of each event, (after, resumeAt) of each gap."""
    seen: list[tuple[int, str]] = []
    gaps: list[tuple[int, int]] = []
    for line in lines:
        if line.startswith("gap "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            gaps.append((int(fields["after"]), int(fields["resumeAt"])))
        elif line[:1].isdigit():
            number, kind = line.split()[:2]
            seen.append((int(number), kind))
    return seen, gaps


@pytest.mark.skipif(not Path("/usr/sbin/nginx").exists(), reason="nginx is missing")
@pytest.mark.timeout(90)
async def test_the_cli_through_nginx_gets_every_event_once_when_its_replica_is_sigkilled(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # `flowcast run` through nginx; the replica that runs the execution and serves the
    # CLI's stream is SIGKILLed mid-run. The other takes the execution over; the CLI
    # reconnects through nginx with Last-Event-ID. It must print each id once, in
    # order, a hole only behind a reported gap, no id naming another event than the
    # stored one, and exit 0 on the completed event.
    async with proxied_pair(valkey, tmp_path) as ((a, b), nginx):
        async with httpx.AsyncClient(base_url=nginx.url, headers=PROXY_AUTH, timeout=20) as via:
            workflow_id = f"cli-{unique}"
            await put(via, talking(workflow_id, words=60, tps=10))
            # A long stream on one replica first (a paused execution's): least_conn then
            # sends the CLI's POST and its stream both to the other, killed below.
            await put(via, approval_workflow(f"ballast-{unique}"))
            ballast_id = await execute(via, f"ballast-{unique}")
            await until_status(via, ballast_id, "paused")
            stream_url = f"/api/executions/{ballast_id}/stream"
            async with via.stream("GET", stream_url) as ballast:
                assert ballast.status_code == 200
                async with asyncio.timeout(10):
                    while await _sse_clients(a.url) + await _sse_clients(b.url) < 1:
                        await asyncio.sleep(0.05)
                victim = b if await _sse_clients(a.url) == 1 else a
                cli = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "app.cli", "--url", nginx.url,
                    "--api-key", PROXY_KEY, "run", workflow_id, "--plain",
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                )  # fmt: skip
                assert cli.stdout is not None and cli.stderr is not None
                lines: list[str] = []
                async with asyncio.timeout(20):
                    while sum(line[:1].isdigit() for line in lines) < 8:
                        raw = await cli.stdout.readline()
                        assert raw, (lines, await cli.stderr.read())
                        lines.append(raw.decode().rstrip("\n"))
                execution_id = lines[0].split()[1]
                assert await _sse_clients(victim.url) == 1  # the CLI's stream is there
                await victim.stop(signal.SIGKILL)
                async with asyncio.timeout(45):
                    rest, errors = await cli.communicate()
                lines += rest.decode().splitlines()
            survivor = a if victim is b else b
            async with httpx.AsyncClient(
                base_url=survivor.url, headers=PROXY_AUTH, timeout=20
            ) as direct:
                stored = (
                    await direct.get(f"/api/executions/{execution_id}/events?after=0&limit=1000")
                ).json()["events"]
    assert cli.returncode == 0, (cli.returncode, lines, errors.decode())
    seen, gaps = _parse_plain(lines)
    ids = [number for number, _ in seen]
    assert ids == sorted(set(ids)), ids
    for before, after in itertools.pairwise(ids):
        if after != before + 1:
            assert (before, after) in gaps, (before, after, gaps)
    by_id = {event["id"]: event["type"] for event in stored}
    clashes = [(n, kind, by_id[n]) for n, kind in seen if n in by_id and by_id[n] != kind]
    assert not clashes, clashes
    assert seen[-1] == (stored[-1]["id"], "execution:completed"), (seen[-5:], stored[-1])
    assert "execution:recovered" in by_id.values()


# ---------------------------------------------------------------- the embedded engine


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]  # a zombie is dead, only not reaped yet


@pytest.mark.timeout(90)
async def test_a_sigkilled_flowcast_serve_takes_its_embedded_engine_down(tmp_path: Path) -> None:
    # The engine now runs in a session of its own (Ctrl-C at the terminal must not reach
    # it first); it must still die with the server it belongs to when that one is
    # killed without a chance to stop it (PR_SET_PDEATHSIG), not hold its port forever.
    from tests.support.servers import wait_ready

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    env.update(
        FLOWCAST_PORT=str(port),
        FLOWCAST_DATA_DIR=str(tmp_path / "data"),
        FLOWCAST_WORKFLOWS_DIR=str(ROOT / "examples"),
    )
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve"],
            cwd=tmp_path, env=env, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    try:
        await wait_ready(f"http://127.0.0.1:{port}", serve, log_path, timeout=60)
        engines = [child for child in _children(serve.pid) if "valkey" in _cmdline(child)]
        assert len(engines) == 1, engines
        serve.kill()
        serve.wait(timeout=10)
        async with asyncio.timeout(15):
            while _alive(engines[0]):
                await asyncio.sleep(0.05)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------- the live list's slot


async def _opens(client: httpx.AsyncClient, query: str = "") -> int:
    async with client.stream("GET", f"{LIVE}?{query}") as response:
        if response.status_code == 200:
            async with asyncio.timeout(FRAME_SECONDS):
                frame = await anext(events(response))
            assert frame.event == "executions", frame
        else:
            await response.aread()
        return response.status_code


@asynccontextmanager
async def held_live(client: httpx.AsyncClient) -> AsyncIterator[httpx.Response]:
    """An open live list, once the slot a closed one held is back (the server gives it
    back when it sees the client leave)."""
    deadline = time.monotonic() + FRAME_SECONDS
    while True:
        async with client.stream("GET", LIVE) as response:
            if response.status_code == 200:
                yield response
                return
            await response.aread()
            assert response.status_code == 429, response.text
            assert time.monotonic() < deadline, "the slot never came back"
        await asyncio.sleep(0.1)


async def _opens_within(client: httpx.AsyncClient, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while (status := await _opens(client)) != 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return status


@pytest.mark.timeout(90)
async def test_a_live_list_gives_its_stream_slot_back_however_redis_fails_around_it(
    own_valkey: ValkeyServer, tmp_path: Path
) -> None:
    # One stream per tenant: every way a live list ends (refused at open because Redis
    # is down, left by its client while Redis is down, ended by SIGTERM while Redis is
    # down) must give the slot back, and a list open through an outage must not be cut.
    key = "slot-key-" + "z" * 20
    server = FlowcastServer(
        data_dir=tmp_path / "server",
        env={
            "FLOWCAST_REDIS_URL": own_valkey.url,
            "FLOWCAST_API_KEYS": key,
            "FLOWCAST_MAX_STREAMS_PER_TENANT": "1",
            "FLOWCAST_SSE_PING_SECONDS": "0.5",
            "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
        },
    )
    await server.start()
    auth = {"Authorization": f"Bearer {key}"}
    try:
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=20) as client:
            own_valkey.kill()
            for _ in range(3):
                assert await _opens(client) == 503
            await own_valkey.start()
            assert await _opens_within(client, 10) == 200

            async with held_live(client) as response:
                every = sse_frames(response)
                assert (await anext(every)).event == "executions"
                own_valkey.kill()
                # Open through the outage: heartbeats, no end.
                pings = 0
                async with asyncio.timeout(FRAME_SECONDS):
                    while pings < 3:
                        pings += "ping" in (await anext(every)).comments
            await own_valkey.start()
            assert await _opens_within(client, 15) == 200

            async with held_live(client) as response:
                own_valkey.kill()
                stopping = asyncio.create_task(server.stop(signal.SIGTERM))
                async with asyncio.timeout(FRAME_SECONDS):
                    await response.aread()  # ends, whatever Redis does
                assert await stopping in (0, -signal.SIGTERM)
    finally:
        await server.stop(signal.SIGKILL)


def quick_workflow(workflow_id: str) -> dict[str, Any]:
    return {
        "id": workflow_id,
        "blocks": [{"id": "only", "type": "transform", "config": {"value": 1}}],
        "edges": [],
    }


@pytest.mark.timeout(120)
async def test_a_live_list_ends_up_as_a_reload_shows_it_after_a_burst_with_lost_messages(
    own_valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # 120 executions started at once while the server's pub/sub connection is killed
    # three times (the messages sent meanwhile are lost): once all are finished the
    # live list, applied frame by frame as a client does, shows what a reload shows.
    server = FlowcastServer(data_dir=tmp_path, env={"FLOWCAST_REDIS_URL": own_valkey.url})
    await server.start()
    admin = Redis.from_url(own_valkey.url)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            workflow_id = f"burst-{unique}"
            await put(client, quick_workflow(workflow_id))
            query = f"workflowId={workflow_id}&limit=200"
            view = View(limit=200)
            async with live_frames(client, query) as frames:
                view.apply(await anext(frames))

                async def start_all() -> list[str]:
                    return await asyncio.gather(*(execute(client, workflow_id) for _ in range(120)))

                starting = asyncio.create_task(start_all())
                for _ in range(3):
                    await asyncio.sleep(0.2)
                    await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                started = await starting
                for execution_id in started:
                    await wait_finished(client, execution_id)
                listed = (await client.get(f"/api/executions?{query}")).json()["executions"]
                truth = [(row["id"], row["status"]) for row in listed]
                assert len(truth) == 120 and {status for _, status in truth} == {"completed"}
                assert await settles_on(frames, view, truth, FRAME_SECONDS) == truth
    finally:
        await admin.aclose()
        await server.stop()


@pytest.mark.timeout(120)
async def test_an_execution_started_while_the_list_is_read_is_never_dropped_from_it(
    own_valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # create() writes the tenant's index and start.lua at once (two keys, two slots on
    # a cluster), so the index can name an execution whose metadata is not there yet.
    # A list read at that moment (GET /api/executions; every live list after a pub/sub
    # reconnect) took it for expired and removed it from the index: the execution ran
    # and finished, and no list ever showed it again.
    server = FlowcastServer(data_dir=tmp_path, env={"FLOWCAST_REDIS_URL": own_valkey.url})
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            workflow_id = f"race-{unique}"
            await put(client, quick_workflow(workflow_id))
            query = f"workflowId={workflow_id}&limit=200"
            done = asyncio.Event()

            async def read_lists() -> None:
                while not done.is_set():
                    assert (await client.get(f"/api/executions?{query}")).status_code == 200

            readers = [asyncio.create_task(read_lists()) for _ in range(3)]
            try:
                started = await asyncio.gather(*(execute(client, workflow_id) for _ in range(120)))
            finally:
                done.set()
                await asyncio.gather(*readers)
            for execution_id in started:
                await wait_finished(client, execution_id)
            listed = (await client.get(f"/api/executions?{query}")).json()["executions"]
    finally:
        await server.stop()
    assert set(started) - {row["id"] for row in listed} == set()


# ---------------------------------------------------------------- tokens


def test_a_list_token_with_its_tenant_cut_off_opens_no_execution() -> None:
    # A list token is "<tenant>.<expiry>.<mac>" with the mac over "list:<tenant>.<expiry>";
    # a stream token is "<expiry>.<mac>" with the mac over "<eid>.<expiry>". Without its
    # first part a list token is a well-formed stream token for the "execution"
    # "list:<tenant>": the tokens module promises neither kind ever passes for the
    # other, and no execution id contains ":".
    from app.tokens import StreamTokens

    tokens = StreamTokens(secret=b"s" * 32, lifetime_seconds=60)
    token = tokens.issue_list("t_abc", now=1_000)
    cut = token.split(".", 1)[1]
    assert not tokens.check(cut, "list:t_abc", now=1_000)
    # An execution's own tokens still work.
    assert tokens.check(tokens.issue("ex_1", now=1_000), "ex_1", now=1_000)


@pytest.mark.skipif(not Path("/usr/sbin/nginx").exists(), reason="nginx is missing")
@pytest.mark.timeout(60)
async def test_the_cli_sends_a_start_nginx_answered_502_again_with_the_same_key(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # nginx answers 502 when the replica it gave a POST to died with it: it may have
    # started the execution, so nginx does not resend it and says "try again (a POST with
    # the same Idempotency-Key)". `flowcast run` makes that key up itself and never
    # prints it: exiting 5 ("worth a retry later") leaves the user a retry with a new
    # key, a second execution if the first had started. It must retry itself.
    from tests.support.proxy import Dropper, NginxProxy

    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": f"b14d{uuid.uuid4().hex[:6]}",
        "FLOWCAST_API_KEYS": PROXY_KEY,
        "FLOWCAST_SECRET_KEY": "break14-secret-" + "s" * 20,
    }
    replica = FlowcastServer(data_dir=tmp_path / "replica", env=env)
    await replica.start()
    try:
        async with Dropper(once=True) as dropper:
            upstreams = (dropper.address, f"127.0.0.1:{replica.port}")
            async with NginxProxy(directory=tmp_path / "nginx", replicas=upstreams) as nginx:
                async with httpx.AsyncClient(
                    base_url=replica.url, headers=PROXY_AUTH, timeout=20
                ) as direct:
                    workflow_id = f"again-{unique}"
                    await put(direct, quick_workflow(workflow_id))
                    cli = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "app.cli", "--url", nginx.url,
                        "--api-key", PROXY_KEY, "run", workflow_id, "--plain",
                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    )  # fmt: skip
                    async with asyncio.timeout(30):
                        out, err = await cli.communicate()
                    listed = (await direct.get(f"/api/executions?workflowId={workflow_id}")).json()[
                        "executions"
                    ]
    finally:
        await replica.stop()
    assert dropper.received == [f"POST /api/workflows/{workflow_id}/execute"]
    assert cli.returncode == 0, (cli.returncode, out.decode(), err.decode())
    assert len(listed) == 1, listed


# ---------------------------------------------------------------- append.lua, one batch


@pytest.mark.timeout(30)
async def test_a_batch_that_writes_back_a_large_checkpoint_is_stored_whole(
    redis: Redis,
) -> None:
    # After the store lost writes, a writer writes its whole checkpoint back with its
    # next batch (writer.py: checkpoint=self._mirror): two fields per block run (its
    # attempt and its output), so over 4000 for a workflow of some 2000 blocks.
    # append.lua set them with HSET(unpack(...)), and Lua unpacks at most ~8000 values:
    # the script failed after storing the events and the metadata, so the batch was
    # half applied, the writer took the retry's ORDER for success, and the checkpoint
    # (what a recovery goes on from) was never written back.
    from lib.execution.buffer import EventBuffer
    from lib.execution.events import Event

    buffer = EventBuffer(redis=redis, prefix=f"b14c{uuid.uuid4().hex[:6]}")
    execution_id = f"ex_{uuid.uuid4().hex}"
    await buffer.create(
        execution_id,
        workflow_id="wf",
        tenant="t",
        owner="owner-1",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
    )
    checkpoint = {}
    for block in range(2100):
        checkpoint[f"t:b{block}"] = b"1"
        checkpoint[f"o:b{block}"] = b'"done"'
    started = Event(
        id=1,
        type="execution:started",
        execution_id=execution_id,
        workflow_id="wf",
        data={"input": {}},
    )
    await buffer.append(execution_id, [started], fence="owner-1", checkpoint=checkpoint)
    stored = await redis.hlen(buffer.keys.state(execution_id))
    assert stored == len(checkpoint)


# ---------------------------------------------------------------- relayed requests, /metrics


async def _status_line(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(10):
            return (await reader.readline()).strip()
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.timeout(60)
async def test_a_keyless_server_refuses_relayed_requests_however_the_headers_are_spelled(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    server = FlowcastServer(
        data_dir=tmp_path,
        env={"FLOWCAST_REDIS_URL": valkey.url, "FLOWCAST_REDIS_PREFIX": "b14open"},
    )
    await server.start()
    try:
        for path in (b"/api/workflows", b"/api/executions/live", b"/metrics", b"/"):
            for headers in (
                b"Host: x\r\nX-Forwarded-For: 203.0.113.9\r\n",
                b"Host: x\r\nx-FORWARDED-for: 203.0.113.9\r\n",
                b"Host: x\r\nX-Forwarded-Proto: https\r\n",
                b"Host: x\r\nX-Forwarded-For: 127.0.0.1\r\nX-Forwarded-For: 203.0.113.9\r\n",
                b"Host: x\r\nForwarded: for=203.0.113.9\r\n",
                b"Host: x\r\nVia: 1.1 proxy\r\n",
                b"Host: x\r\nX-Real-IP: 203.0.113.9\r\n",
            ):
                for version in (b"HTTP/1.1", b"HTTP/1.0"):
                    request = b"GET " + path + b" " + version + b"\r\n" + headers + b"\r\n"
                    line = await _status_line(server.port, request)
                    assert line.split()[1] == b"403", (request, line)
            # This machine's own client, unrelayed, is answered.
            ok = await _status_line(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ok.split()[1] == b"200"
    finally:
        await server.stop()


@pytest.mark.timeout(60)
async def test_metrics_behind_keys_take_only_a_key(valkey: ValkeyServer, tmp_path: Path) -> None:
    key = "metrics-key-" + "m" * 20
    server = FlowcastServer(
        data_dir=tmp_path,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": "b14metrics",
            "FLOWCAST_API_KEYS": key,
        },
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            auth = {"Authorization": f"Bearer {key}"}
            list_token = (await client.post(f"{LIVE}/token", headers=auth)).json()["streamToken"]
            for url, headers in (
                ("/metrics", {}),
                ("/metrics", {"Authorization": "Bearer nope"}),
                (f"/metrics?token={list_token}", {}),
                (f"/metrics?%74oken={list_token}", {}),
                ("/metrics", {"Authorization": f"Basic {key}"}),
            ):
                response = await client.get(url, headers=headers)
                assert response.status_code == 401, (url, headers, response.status_code)
            for path in (b"/metrics/", b"/Metrics", b"//metrics", b"/metrics%2F", b"/./metrics"):
                request = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n"
                line = await _status_line(server.port, request)
                # Not found, or a redirect to /metrics (which takes a key, as above).
                assert line.split()[1] in (b"401", b"404", b"307"), (path, line)
            assert (await client.get("/metrics", headers=auth)).status_code == 200
    finally:
        await server.stop()
