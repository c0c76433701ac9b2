"""The ``flowcast`` client commands, run as subprocesses against real servers."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import select
import shutil
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.client import Event, FlowcastClient, Gap, Reconnecting
from app.embedded import free_port
from app.progress import LiveDisplay, PlainDisplay
from tests.support.api import flaky_workflow, put, streaming_workflow
from tests.support.servers import FlowcastServer, ValkeyServer, authed, serving
from tests.support.terminal import pty_process

try:
    import pyte
except ImportError:  # a dev dependency: an older venv lacks it until `make install`
    pyte = None

FLOWCAST = Path(sys.executable).with_name("flowcast")
# The terminal tests play what the CLI draws into pyte, a terminal emulator.
on_a_terminal = pytest.mark.skipif(pyte is None, reason="pyte is not installed (make install)")
KEY = "cli-key-" + uuid.uuid4().hex[:8]
EVENT_LINE = re.compile(r"^(\d+) (\S+)")
APPROVAL = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}},
}


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def event_ids(self) -> list[int]:
        return [int(m.group(1)) for line in self.out.splitlines() if (m := EVENT_LINE.match(line))]

    @property
    def output(self) -> Any:
        return json.loads(self.out.splitlines()[-1])


def cli_env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
    return {**base, **extra}


async def flowcast(*args: str, url: str | None, timeout: float = 30, **env: str) -> Result:
    """Run one CLI command to its end (stdout is a pipe: the plain display); ``--url``
    goes last unless ``url`` is None."""
    process = await asyncio.create_subprocess_exec(
        str(FLOWCAST),
        *args,
        *(["--url", url] if url is not None else []),
        env=cli_env(**env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


def workflow(workflow_id: str, *blocks: dict[str, Any]) -> dict[str, Any]:
    """Blocks in a chain."""
    edges = [{"from": a["id"], "to": b["id"]} for a, b in pairwise(blocks)]
    return {"id": workflow_id, "blocks": list(blocks), "edges": edges}


async def test_run_follows_an_execution_to_its_output(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"cli-ok-{unique}", words=12))
    result = await flowcast(
        "run", f"cli-ok-{unique}", "--input", '{"name": "ada"}', url=str(client.base_url)
    )
    assert result.code == 0, result.err
    assert result.output == {"done": {"who": "ada"}}
    chunks = [line for line in result.out.splitlines() if " block:chunk talk " in line]
    assert "".join(json.loads(line.split(" ", 3)[3]) for line in chunks).split() == [
        f"w{i}" for i in range(12)
    ]
    assert re.search(r"^\d+ block:completed talk \d+ms$", result.out, re.MULTILINE)
    ids = result.event_ids
    assert ids == list(range(1, len(ids) + 1))


async def test_run_of_a_failing_workflow_exits_1(client: httpx.AsyncClient, unique: str) -> None:
    await put(
        client,
        workflow(
            f"cli-fail-{unique}", {"id": "boom", "type": "fail", "config": {"message": "it broke"}}
        ),
    )
    result = await flowcast("run", f"cli-fail-{unique}", url=str(client.base_url))
    assert result.code == 1, result.err
    assert "execution:failed" in result.out
    assert "it broke" in result.err


async def test_cancel_from_another_command_ends_run_with_3(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(
        client,
        workflow(f"cli-long-{unique}", {"id": "wait", "type": "delay", "config": {"ms": 60_000}}),
    )
    url = str(client.base_url)
    process = await asyncio.create_subprocess_exec(
        str(FLOWCAST),
        "run",
        f"cli-long-{unique}",
        "--url",
        url,
        env=cli_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        async with asyncio.timeout(30):
            first = (await process.stdout.readline()).decode()
            execution_id = first.split()[1]
            # Cancel once the delay is running, as seen by the follower itself.
            seen = [first]
            while "block:started wait" not in seen[-1]:
                seen.append((await process.stdout.readline()).decode())
            cancelled = await flowcast("cancel", execution_id, url=url)
            assert cancelled.code == 0, cancelled.err
            rest, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 3, err
    assert re.search(r"^\d+ execution:cancelled", rest.decode(), re.MULTILINE)
    again = await flowcast("cancel", execution_id, url=url)
    assert again.code == 2, "a finished execution cannot be cancelled"
    assert "409" in again.err


async def test_run_stops_at_a_pause_and_attach_finishes_after_resume(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(
        client,
        workflow(
            f"cli-ask-{unique}",
            {"id": "ask", "type": "approval", "config": {"prompt": "Ship it?", "schema": APPROVAL}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ),
    )
    url = str(client.base_url)
    paused = await flowcast("run", f"cli-ask-{unique}", url=url)
    assert paused.code == 4, paused.err
    execution_id = paused.out.splitlines()[0].split()[1]
    # The hint names the command the way it was started (here the venv's script, unless
    # it is what the shell finds as "flowcast").
    found = shutil.which("flowcast")
    started = "flowcast" if found and Path(found).resolve() == FLOWCAST.resolve() else FLOWCAST
    assert f"{started} resume {execution_id} --block ask --input" in paused.err
    assert f"{started} approve {execution_id}  (or reject)" in paused.err
    assert f"{started} attach {execution_id} --after" in paused.err
    assert "Ship it?" in paused.err
    last = paused.event_ids[-1]

    attached = await flowcast("attach", execution_id, url=url)
    assert attached.code == 4, "attach stops at the pause too"

    refused = await flowcast("resume", execution_id, "--input", '{"approved": "yes"}', url=url)
    assert refused.code == 2
    assert "schema" in refused.err and "approved" in refused.err

    resumed = await flowcast(
        "resume", execution_id, "--input", '{"approved": true}', "--block", "ask", url=url
    )
    assert resumed.code == 0, resumed.err

    finished = await flowcast("attach", execution_id, "--after", str(last), url=url)
    assert finished.code == 0, finished.err
    assert finished.output == {"done": {"approved": True}}
    assert finished.event_ids[0] == last + 1
    assert "execution:resumed" in finished.out

    replayed = await flowcast("attach", execution_id, url=url)
    assert replayed.code == 0, "a pause that was answered does not stop a replay"
    assert replayed.event_ids == list(range(1, len(replayed.event_ids) + 1))


async def test_run_with_wait_follows_through_a_pause(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(
        client,
        workflow(
            f"cli-wait-{unique}",
            {"id": "ask", "type": "approval", "config": {"prompt": "Go?", "schema": APPROVAL}},
        ),
    )
    url = str(client.base_url)
    process = await asyncio.create_subprocess_exec(
        str(FLOWCAST),
        "run",
        f"cli-wait-{unique}",
        "--wait",
        "--url",
        url,
        env=cli_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(30):
            execution_id = (await process.stdout.readline()).decode().split()[1]
            while b"execution:paused" not in await process.stdout.readline():
                pass
            answer = await flowcast(
                "resume", execution_id, "--input", '{"approved": false}', url=url
            )
            assert answer.code == 0, answer.err
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err
    assert json.loads(out.decode().splitlines()[-1]) == {"ask": {"approved": False}}


def _run_on_a_terminal(
    args: list[str], timeout: float, *, stderr_too: bool = False
) -> tuple[int, list[str]]:
    """Run the CLI with a pseudo-terminal as stdout (and stderr, if asked), its output
    played into a terminal emulator: the exit code and the screen as a person sees it."""
    screen = pyte.Screen(100, 50)
    stream = pyte.ByteStream(screen)
    env = cli_env(COLUMNS="100", LINES="50", TERM="xterm-256color")
    with pty_process(args, env, stderr=stderr_too) as (process, main):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not select.select([main], [], [], 0.5)[0]:
                continue
            try:
                chunk = os.read(main, 65536)  # EIO once the child's side is closed
            except OSError:
                break
            if not chunk:
                break
            stream.feed(chunk)
        code = process.wait(max(deadline - time.monotonic(), 1.0))
    return code, [line.rstrip() for line in screen.display]


def _lines_with(screen: list[str], text: str) -> list[int]:
    return [i for i, line in enumerate(screen) if text in line]


@on_a_terminal
async def test_run_on_a_terminal_shows_one_line_per_block_redrawn_in_place(
    client: httpx.AsyncClient,
) -> None:
    args = [str(FLOWCAST), "run", "parallel-report", "--url", str(client.base_url)]
    code, screen = await asyncio.wait_for(asyncio.to_thread(_run_on_a_terminal, args, 30), 40)
    shown = "\n".join(screen)
    assert code == 0, shown
    header = _lines_with(screen, "parallel-report  ")
    assert len(header) == 1, f"the view is redrawn in place, not printed again:\n{shown}"
    assert re.fullmatch(r"ex_\S+  parallel-report  completed  \d+\.\ds", screen[header[0]])
    rows = screen[header[0] + 1 : header[0] + 6]
    for row, block in zip(rows, ("outline", "sales", "support", "usage", "report"), strict=True):
        assert re.match(rf"  ✓ {block} +\w+ +completed +\d+\.\d\ds", row), shown
    assert rows[3].endswith(" Usage grew in every region this week."), "the streamed text"
    assert screen[header[0] + 6] == "{", "the output follows, as pretty-printed JSON"
    assert '"title": "Report on flows"' in shown


async def test_list_shows_recent_executions_as_a_table(
    client: httpx.AsyncClient, unique: str
) -> None:
    await put(client, streaming_workflow(f"cli-list-{unique}", words=2))
    url = str(client.base_url)
    ran = [await flowcast("run", f"cli-list-{unique}", url=url) for _ in range(2)]
    ids = [result.out.splitlines()[0].split()[1] for result in ran]
    listed = await flowcast(
        "list", "--workflow", f"cli-list-{unique}", "--status", "completed", url=url
    )
    assert listed.code == 0, listed.err
    header, *rows = listed.out.splitlines()
    assert header.split() == [
        "ID", "WORKFLOW", "STATUS", "EVENTS", "CREATED", "UPDATED", "DURATION"
    ]  # fmt: skip
    assert [row.split()[0] for row in rows] == ids[::-1], "newest first"
    assert all(row.split()[1:3] == [f"cli-list-{unique}", "completed"] for row in rows)
    limited = await flowcast("list", "--workflow", f"cli-list-{unique}", "--limit", "1", url=url)
    assert len(limited.out.splitlines()) == 2


async def test_bad_input_exits_2_with_the_servers_message(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    unknown = await flowcast("run", f"no-such-{unique}", url=url)
    assert unknown.code == 2
    assert f"workflow 'no-such-{unique}' was not found" in unknown.err
    missing = await flowcast("attach", f"ex_missing{unique}", url=url)
    assert missing.code == 2 and "not found" in missing.err
    status = await flowcast("list", "--status", "sleeping", url=url)
    assert status.code == 2 and "status must be one of" in status.err
    not_json = await flowcast("run", "stream-story", "--input", "{nope", url=url)
    assert not_json.code == 2 and "not valid JSON" in not_json.err


async def test_an_unreachable_server_exits_5() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for command in (["run", "stream-story"], ["list"], ["attach", "ex_x"], ["cancel", "ex_x"]):
        result = await flowcast(*command, url=url)
        assert result.code == 5, (command, result.err)
        assert "cannot reach the server" in result.err


@pytest.fixture(scope="module")
async def keyed(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    async with serving(
        valkey, tmp_path_factory.mktemp("cli-keyed"), api_keys=KEY, event_limit="10"
    ) as server:
        yield server


async def test_api_key_comes_from_the_option_or_the_environment(keyed: FlowcastServer) -> None:
    without = await flowcast("list", url=keyed.url)
    assert without.code == 2 and "API key is required" in without.err
    wrong = await flowcast("list", "--api-key", "nope", url=keyed.url)
    assert wrong.code == 2 and "not valid" in wrong.err
    ran = await flowcast("run", "route-ticket", "--api-key", KEY, url=keyed.url)
    assert ran.code == 0, ran.err
    listed = await flowcast("list", url=keyed.url, FLOWCAST_API_KEY=KEY)
    assert listed.code == 0, listed.err
    assert ran.out.splitlines()[0].split()[1] in listed.out


async def test_attach_after_eviction_prints_the_gap_and_goes_on(
    keyed: FlowcastServer, unique: str
) -> None:
    async with authed(keyed, KEY) as client:
        await put(client, streaming_workflow(f"cli-gap-{unique}", words=20))
    ran = await flowcast("run", f"cli-gap-{unique}", "--api-key", KEY, url=keyed.url)
    assert ran.code == 0, ran.err
    execution_id = ran.out.splitlines()[0].split()[1]
    last = ran.event_ids[-1]

    attached = await flowcast("attach", execution_id, "--api-key", KEY, url=keyed.url)
    assert attached.code == 0, attached.err
    gap = next(line for line in attached.out.splitlines() if line.startswith("gap "))
    resume_at = last - 10 + 1  # the ring keeps the newest 10 events
    assert gap == f"gap after=0 resumeAt={resume_at} reason=evicted"
    assert f"are no longer retained (evicted); continuing at {resume_at}" in attached.err
    assert attached.event_ids == list(range(resume_at, last + 1))
    assert attached.output == ran.output


async def test_url_comes_from_the_environment(client: httpx.AsyncClient) -> None:
    process = await asyncio.create_subprocess_exec(
        str(FLOWCAST),
        "list",
        "--limit",
        "1",
        env=cli_env(FLOWCAST_URL=str(client.base_url)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        _, err = await process.communicate()
    assert process.returncode == 0, err


@pytest.fixture(scope="module")
async def short_streams(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    async with serving(valkey, tmp_path_factory.mktemp("cli-short"), sse_max_seconds="1") as server:
        yield server


async def test_run_reconnects_when_the_server_closes_the_stream(
    short_streams: FlowcastServer, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=short_streams.url, timeout=20) as client:
        await put(client, streaming_workflow(f"cli-drop-{unique}", words=30, tps=10))
        result = await flowcast(
            "run", f"cli-drop-{unique}", "--input", '{"name": "x"}', url=short_streams.url
        )
        execution_id = result.out.splitlines()[0].split()[1]
        snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
    assert result.code == 0, result.err
    assert result.err.count("reconnecting after event") >= 2, "the ~3 s run outlived 1 s streams"
    assert result.event_ids == list(range(1, snapshot["lastEventId"] + 1)), "each id exactly once"
    assert result.output == {"done": {"who": "x"}}


@on_a_terminal
async def test_run_on_a_terminal_prints_reconnect_notices_above_the_view(
    short_streams: FlowcastServer, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=short_streams.url, timeout=20) as client:
        await put(client, streaming_workflow(f"cli-tty-{unique}", words=30, tps=10))
    args = [
        str(FLOWCAST), "run", f"cli-tty-{unique}", "--input", '{"name": "x"}',
        "--url", short_streams.url,
    ]  # fmt: skip
    run = asyncio.to_thread(_run_on_a_terminal, args, 30, stderr_too=True)
    code, screen = await asyncio.wait_for(run, 40)
    shown = "\n".join(screen)
    assert code == 0, shown
    notices = _lines_with(screen, "flowcast: stream ended")
    assert len(notices) >= 2, f"the ~3 s run outlived 1 s streams:\n{shown}"
    header = _lines_with(screen, f"cli-tty-{unique}  completed")
    assert len(header) == 1 and header[0] > notices[-1], f"notices go above the view:\n{shown}"
    for block in ("intro", "talk", "done"):
        assert len(_lines_with(screen, f"✓ {block} ")) == 1, shown
    talk = screen[_lines_with(screen, "✓ talk ")[0]]
    assert talk.endswith(" w27 w28 w29"), "the tail of the streamed text"


class _Stream(httpx.BaseTransport):
    """Answers each stream request with the next canned SSE body; records the cursors."""

    def __init__(self, *bodies: bytes) -> None:
        self.bodies = list(bodies)
        self.cursors: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.cursors.append(request.headers.get("Last-Event-ID"))
        if not self.bodies:
            return httpx.Response(204)
        return httpx.Response(
            200, headers={"Content-Type": "text/event-stream"}, content=self.bodies.pop(0)
        )


def _frame(id: int, type: str) -> bytes:
    envelope = {"id": id, "type": type, "executionId": "ex_t", "workflowId": "wf", "data": {}}
    return f"id: {id}\nevent: {type}\ndata: {json.dumps(envelope)}\n\n".encode()


def test_follow_resumes_after_a_frame_cut_off_and_reports_the_gap() -> None:
    gap = {"after": 2, "resumeAt": 4, "reason": "evicted"}
    transport = _Stream(
        # A heartbeat, two events, then a frame the connection lost halfway.
        b": ping\n\n" + _frame(1, "execution:started") + _frame(2, "block:started")
        + b'id: 3\nevent: block:chunk\ndata: {"id": 3,',
        # The next connection repeats event 2 (never shown twice), then a gap.
        _frame(2, "block:started")
        + f"event: replay:gap\ndata: {json.dumps(gap)}\n\n".encode()
        + _frame(4, "execution:completed"),
    )  # fmt: skip
    with FlowcastClient("http://flowcast.test", transport=transport) as client:
        items = list(client.follow("ex_t"))
    assert transport.cursors == ["0", "2"], "reconnects with Last-Event-ID of the last event"
    assert [type(item).__name__ for item in items] == [
        "Event", "Event", "Reconnecting", "Gap", "Event"
    ]  # fmt: skip
    assert [item.id for item in items if isinstance(item, Event)] == [1, 2, 4]
    assert isinstance(items[2], Reconnecting) and items[2].cursor == 2
    assert items[3] == Gap(after=2, resume_at=4, reason="evicted")


def test_follow_ends_at_a_204() -> None:
    transport = _Stream()
    with FlowcastClient("http://flowcast.test", transport=transport) as client:
        items = list(client.follow("ex_t", after=9))
    assert transport.cursors == ["9"]
    assert [type(item).__name__ for item in items] == ["Finished"]


class _Failing(BaseHTTPRequestHandler):
    """A server that cannot serve: every request is a 503 with Flowcast's error body."""

    def _answer(self) -> None:
        body = b'{"error": {"code": "buffer_unavailable", "message": "the buffer is down"}}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def failing_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


async def test_a_5xx_exits_5_with_the_servers_message(failing_server: str) -> None:
    for command in (["list"], ["cancel", "ex_x"], ["attach", "ex_x"]):
        result = await flowcast(*command, url=failing_server)
        assert result.code == 5, (command, result.err)
        assert "the buffer is down (503 buffer_unavailable)" in result.err


async def test_url_and_api_key_go_before_or_after_the_command(keyed: FlowcastServer) -> None:
    before = await flowcast("--url", keyed.url, "--api-key", KEY, "list", url=None)
    assert before.code == 0, before.err
    after = await flowcast("list", "--api-key", KEY, "--url", keyed.url, url=None)
    assert after.code == 0, after.err
    mixed = await flowcast("--api-key", KEY, "list", url=keyed.url)
    assert mixed.code == 0, mixed.err
    unreachable = f"http://127.0.0.1:{free_port()}"
    wins = await flowcast("--url", unreachable, "list", "--api-key", KEY, url=keyed.url)
    assert wins.code == 0, "the --url after the command wins"
    from_env = await flowcast("--api-key", KEY, "list", url=None, FLOWCAST_URL=keyed.url)
    assert from_env.code == 0, from_env.err
    over_env = await flowcast("--api-key", KEY, "list", url=keyed.url, FLOWCAST_API_KEY="nope")
    assert over_env.code == 0, "an option, before or after, wins over the environment"


@pytest.fixture(scope="module")
async def plugged(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    """A server with the test plugins, among them ``flaky`` (streams, then fails once)."""
    async with serving(
        valkey, tmp_path_factory.mktemp("cli-plugged"), plugins="tests.support.plugins"
    ) as server:
        yield server


async def test_a_retried_block_prints_both_attempts_in_plain(
    plugged: FlowcastServer, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, flaky_workflow(f"cli-flaky-{unique}"))
    plain = await flowcast("run", f"cli-flaky-{unique}", url=plugged.url)
    assert plain.code == 0, plain.err
    assert re.search(r"^\d+ block:failed talk attempt=1 retry=yes flaky: ", plain.out, re.M)
    assert re.search(r"^\d+ block:started talk type=python attempt=2$", plain.out, re.M)


@on_a_terminal
async def test_a_retried_block_shows_only_its_latest_attempts_text_on_a_terminal(
    plugged: FlowcastServer, unique: str
) -> None:
    async with httpx.AsyncClient(base_url=plugged.url, timeout=20) as client:
        await put(client, flaky_workflow(f"cli-flaky-{unique}"))
    args = [str(FLOWCAST), "run", f"cli-flaky-{unique}", "--url", plugged.url]
    code, screen = await asyncio.wait_for(asyncio.to_thread(_run_on_a_terminal, args, 30), 40)
    shown = "\n".join(screen)
    assert code == 0, shown
    (talk,) = [line for line in screen if " talk " in line]
    assert re.fullmatch(
        r"  ✓ talk +python +completed +\d+\.\d\ds attempt 2 · try2-w0 try2-w1 try2-w2", talk
    ), shown
    assert "try1" not in shown, "the failed attempt's text is not joined to the next one's"


def _event(id: int, type: str, **data: Any) -> Event:
    envelope = {"id": id, "type": type, "executionId": "ex_r", "workflowId": "wf", "data": data}
    return Event(id=id, type=type, data=data, envelope=envelope)


RECOVERED_RUN = [
    _event(1, "execution:started", input=None),
    _event(2, "block:started", blockId="kept", blockType="transform", attempt=1),
    _event(3, "block:completed", blockId="kept", output=1, durationMs=3),
    _event(4, "block:started", blockId="talk", blockType="generate", attempt=1),
    _event(5, "block:chunk", blockId="talk", text="lost words "),
    _event(
        6,
        "execution:recovered",
        reason="worker_lost",
        recovery=1,
        rerun=["talk"],
        completed=["kept"],
    ),
    _event(7, "block:started", blockId="talk", blockType="generate", attempt=2),
    _event(8, "block:chunk", blockId="talk", text="fresh words"),
]


def test_plain_display_prints_a_recovery_as_a_line_and_a_notice() -> None:
    out, err = io.StringIO(), io.StringIO()
    display = PlainDisplay(out, err)
    for event in RECOVERED_RUN:
        display.event(event)
    lines = out.getvalue().splitlines()
    assert lines[5] == "6 execution:recovered worker_lost recovery=1 rerun=talk completed=kept"
    assert lines[6] == "7 block:started talk type=generate attempt=2"
    assert err.getvalue() == (
        "flowcast: recovered (worker_lost), 1 block re-run, 1 kept from the checkpoint\n"
    )


def test_live_display_keeps_running_through_a_recovery_and_restarts_the_rerun_text() -> None:
    out, err = io.StringIO(), io.StringIO()
    display = LiveDisplay(out, err)
    display.started("ex_r", "wf")
    for event in RECOVERED_RUN[:6]:
        display.event(event)
    assert display.status == "running"
    assert (display.blocks["talk"].status, display.blocks["talk"].detail) == ("running", "re-run")
    for event in RECOVERED_RUN[6:]:
        display.event(event)
    display.close()
    # Not a terminal: rich draws the view once, when it stops.
    final = [line.rstrip() for line in out.getvalue().splitlines()]
    assert re.fullmatch(r"ex_r  wf  running  \d+\.\ds", final[0])
    assert re.fullmatch(r"  ✓ kept +transform +completed +0\.00s", final[1])
    assert re.fullmatch(r"  … talk +generate +running +\d+\.\ds +attempt 2 · fresh words", final[2])
    assert final[3:] == []
    assert err.getvalue() == (
        "flowcast: recovered (worker_lost), 1 block re-run, 1 kept from the checkpoint\n"
    )
    display.event(
        _event(9, "execution:recovered", reason="handoff", recovery=2, rerun=[], completed=[])
    )
    assert display.status == "running"
    assert err.getvalue().endswith(
        "flowcast: recovered (handoff), 0 blocks re-run, 0 kept from the checkpoint\n"
    )


def test_live_display_cuts_the_text_at_its_front_to_fit_the_terminal() -> None:
    out = io.StringIO()
    display = LiveDisplay(out, io.StringIO())
    display.console.width = 60
    display.started("ex_w", "wf")
    display.event(_event(1, "block:started", blockId="talk", blockType="generate", attempt=1))
    display.event(_event(2, "block:chunk", blockId="talk", text=" ".join(map(str, range(50)))))
    display.close()
    talk = out.getvalue().splitlines()[1].rstrip()
    assert len(talk) <= 60 - 3, "three columns stay free for the ^C echo"
    assert re.fullmatch(r"  … talk generate running \d+\.\ds …[\d ]+ 47 48 49", talk), talk
