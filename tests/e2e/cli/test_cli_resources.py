"""``flowcast workflows``, ``describe``, ``events``, ``approve``/``reject`` and ``secrets``,
run as subprocesses against the session's real server."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.embedded import free_port
from tests.e2e.cli.test_cli import FLOWCAST, Result, cli_env, flowcast, workflow
from tests.support.api import put, streaming_workflow, wait_status
from tests.support.terminal import pty_process

CTRL_C = "\x03"
REVIEW = {
    "type": "object",
    "required": ["approved", "priority"],
    "properties": {
        "approved": {"type": "boolean"},
        "priority": {"enum": ["low", "high"], "description": "how soon"},
        "count": {"type": "integer", "default": 3},
        "note": {"type": "string"},
    },
}


async def piped(*args: str, url: str, stdin: bytes) -> Result:
    """Run one CLI command with ``stdin`` on a pipe."""
    process = await asyncio.create_subprocess_exec(
        str(FLOWCAST), *args, "--url", url, env=cli_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30):
            out, err = await process.communicate(stdin)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


def _converse(args: list[str], steps: list[tuple[str, str]], timeout: float) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal (stdin, stdout and stderr): for each step, wait
    until the screen shows its text, then type its reply. The exit code and every byte
    the terminal showed (what was typed is echoed, unless the CLI turned echo off)."""
    deadline = time.monotonic() + timeout
    with pty_process(args, cli_env(TERM="dumb"), stdin=True) as (process, main):
        code, pending, shown = _steps(process, main, steps, deadline)
    assert not pending, f"never asked {pending[0][0]!r}:\n{shown.decode(errors='replace')}"
    return code, shown.decode(errors="replace")


def _steps(
    process: subprocess.Popen[bytes], main: int, steps: list[tuple[str, str]], deadline: float
) -> tuple[int, list[tuple[str, str]], bytes]:
    """``_converse``'s loop: the exit code, the steps never reached, what was shown."""
    shown = b""
    pending, since = list(steps), 0
    interrupted = 0.0  # when Ctrl-C was last pressed (0: not yet)
    while True:
        if pending and pending[0][0].encode() in shown[since:]:
            reply = pending.pop(0)[1]
            if reply == CTRL_C:  # what the terminal does when a person types it
                process.send_signal(signal.SIGINT)
                interrupted = time.monotonic()
            else:
                os.write(main, reply.encode())
            since = len(shown)
        elif interrupted and time.monotonic() - interrupted > 1.0 and process.poll() is None:
            process.send_signal(signal.SIGINT)  # pressed again, as a person would
            interrupted = time.monotonic()
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; the terminal shows:\n{shown.decode(errors='replace')}"
        ready, _, _ = select.select([main], [], [], min(left, 0.5))
        if not ready:
            continue
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child's side is closed
            break
        if not chunk:
            break
        shown += chunk
    return process.wait(max(deadline - time.monotonic(), 1.0)), pending, shown


async def on_a_terminal(
    args: list[str], steps: list[tuple[str, str]], timeout: float = 30
) -> tuple[int, str]:
    async with asyncio.timeout(timeout + 10):
        return await asyncio.to_thread(_converse, [str(FLOWCAST), *args], steps, timeout)


async def _paused(client: httpx.AsyncClient, workflow_id: str, schema: Any) -> str:
    """A new execution of a one-approval workflow, paused."""
    await put(
        client,
        workflow(
            workflow_id,
            {"id": "ask", "type": "approval", "config": {"prompt": "Ship?", "schema": schema}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ),
    )
    started = await client.post(f"/api/workflows/{workflow_id}/execute", json={"input": None})
    execution_id: str = started.json()["executionId"]
    await wait_status(client, execution_id, "paused")
    return execution_id


async def _answer_of(client: httpx.AsyncClient, execution_id: str) -> Any:
    await wait_status(client, execution_id, "completed")
    snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
    return snapshot["output"]["done"]


@pytest.mark.timeout(60)
async def test_workflows_apply_list_show_and_delete(
    client: httpx.AsyncClient, unique: str, tmp_path: Path
) -> None:
    url = str(client.base_url)
    workflow_id = f"cli-wf-{unique}"
    document = streaming_workflow(workflow_id, words=2)
    document["edges"][1]["when"] = "blocks.talk.output.text"
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(document))

    created = await flowcast("workflows", "apply", str(path), url=url)
    assert (created.code, created.out) == (0, f"{workflow_id} created\n"), created.err
    replaced = await flowcast("workflows", "apply", str(path), url=url)
    assert (replaced.code, replaced.out) == (0, f"{workflow_id} replaced\n"), replaced.err

    listed = await flowcast("workflows", "list", url=url)
    assert listed.code == 0, listed.err
    assert listed.out.splitlines()[0].split() == ["ID", "NAME", "BLOCKS", "SOURCE"]
    assert f"{workflow_id}  " in listed.out and "stream-story" in listed.out
    as_json = json.loads((await flowcast("workflows", "list", "-o", "json", url=url)).out)
    (mine,) = [w for w in as_json["workflows"] if w["id"] == workflow_id]
    assert (mine["blocks"], mine["source"]) == (3, "api")

    shown = await flowcast("workflows", "show", workflow_id, url=url)
    assert shown.code == 0, shown.err
    assert "source:      api" in shown.out
    assert "  talk   generate" in shown.out
    assert "  talk → done  when blocks.talk.output.text" in shown.out
    shown_json = await flowcast("workflows", "show", workflow_id, "-o", "json", url=url)
    stored = json.loads(shown_json.out)
    assert stored["source"] == "api" and stored["blocks"][1]["id"] == "talk"
    # What `show -o json` prints can be applied again as it is.
    path.write_text(shown_json.out)
    again = await flowcast("workflows", "apply", str(path), url=url)
    assert (again.code, again.out) == (0, f"{workflow_id} replaced\n"), again.err

    deleted = await flowcast("workflows", "delete", workflow_id, url=url)
    assert (deleted.code, deleted.out) == (0, f"{workflow_id} deleted\n"), deleted.err
    gone = await flowcast("workflows", "show", workflow_id, url=url)
    assert gone.code == 2 and f"workflow '{workflow_id}' was not found (404" in gone.err
    assert len(gone.err.splitlines()) == 1, "one line: the server's message"
    again_gone = await flowcast("workflows", "delete", workflow_id, url=url)
    assert again_gone.code == 2 and "not found" in again_gone.err


@pytest.mark.timeout(60)
async def test_workflows_apply_refuses_bad_documents_with_the_servers_problems(
    client: httpx.AsyncClient, unique: str, tmp_path: Path
) -> None:
    url = str(client.base_url)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(workflow(f"cli-bad-{unique}", {"id": "x", "type": "nope"})))
    refused = await flowcast("workflows", "apply", str(bad), url=url)
    assert refused.code == 2 and refused.out == ""
    assert "(422 " in refused.err.splitlines()[0]
    assert "$.blocks[0]" in refused.err, "each problem with its path"

    nameless = tmp_path / "nameless.json"
    nameless.write_text(json.dumps({"blocks": [{"id": "a", "type": "transform"}]}))
    no_id = await flowcast("workflows", "apply", str(nameless), url=url)
    assert no_id.code == 2 and 'has no "id": give one with --id' in no_id.err
    given = await flowcast("workflows", "apply", str(nameless), "--id", f"cli-id-{unique}", url=url)
    assert (given.code, given.out) == (0, f"cli-id-{unique} created\n"), given.err
    named = tmp_path / "named.json"
    named.write_text(json.dumps(workflow(f"cli-a-{unique}", {"id": "a", "type": "transform"})))
    copied = await flowcast("workflows", "apply", str(named), "--id", f"cli-b-{unique}", url=url)
    assert (copied.code, copied.out) == (0, f"cli-b-{unique} created\n"), "--id wins"
    assert (await client.get(f"/api/workflows/cli-b-{unique}")).json()["id"] == f"cli-b-{unique}"

    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    not_json = await flowcast("workflows", "apply", str(broken), url=url)
    assert not_json.code == 2 and "cannot read a workflow from" in not_json.err
    from_stdin = await piped(
        "workflows", "apply", "-", url=url,
        stdin=json.dumps(workflow(f"cli-in-{unique}", {"id": "a", "type": "transform"})).encode(),
    )  # fmt: skip
    assert (from_stdin.code, from_stdin.out) == (0, f"cli-in-{unique} created\n"), from_stdin.err
    shipped = await flowcast("workflows", "delete", "stream-story", url=url)
    assert shipped.code == 2, "a workflow loaded from a file is not the API's to delete"


@pytest.mark.timeout(60)
async def test_describe_shows_the_status_input_and_output(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    await put(client, streaming_workflow(f"cli-desc-{unique}", words=3))
    ran = await flowcast("run", f"cli-desc-{unique}", "--input", '{"name": "ada"}', url=url)
    execution_id = ran.out.splitlines()[0].split()[1]

    described = await flowcast("describe", execution_id, url=url)
    assert described.code == 0, described.err
    lines = described.out.splitlines()
    assert lines[:3] == [
        f"id:       {execution_id}",
        f"workflow: cli-desc-{unique}",
        "status:   completed",
    ]
    assert any(line.startswith("duration: ") and line.endswith("s") for line in lines)
    text = described.out
    assert 'input: {\n  "name": "ada"\n}' in text
    assert 'output: {\n  "done": {\n    "who": "ada"\n  }\n}' in text

    as_json = json.loads((await flowcast("describe", execution_id, "-o", "json", url=url)).out)
    snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
    assert as_json == {**snapshot, "input": {"name": "ada"}}

    missing = await flowcast("describe", f"ex_missing{unique}", url=url)
    assert missing.code == 2 and "not found" in missing.err


@pytest.mark.timeout(60)
async def test_describe_a_paused_and_a_failed_execution(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    paused = await _paused(client, f"cli-dp-{unique}", REVIEW)
    shown = await flowcast("describe", paused, url=url)
    assert shown.code == 0, shown.err
    assert "status:   paused at block 'ask': Ship?" in shown.out
    assert f"approve {paused}  (or reject)" in shown.out
    assert "output:" not in shown.out

    await put(
        client,
        workflow(f"cli-df-{unique}", {"id": "boom", "type": "fail", "config": {"message": "bad"}}),
    )
    failed = await flowcast("run", f"cli-df-{unique}", url=url)
    execution_id = failed.out.splitlines()[0].split()[1]
    shown = await flowcast("describe", execution_id, url=url)
    assert shown.code == 0, "describing a failed execution succeeds"
    assert "status:   failed" in shown.out
    assert "error:    block_failed in block 'boom': bad" in shown.out


@pytest.mark.timeout(60)
async def test_events_prints_every_stored_event_across_pages(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    await put(client, streaming_workflow(f"cli-ev-{unique}", words=1100))
    ran = await flowcast("run", f"cli-ev-{unique}", "-q", url=url)
    assert ran.code == 0, ran.err
    (execution_id,) = [
        e["id"] for e in (await client.get(
            "/api/executions", params={"workflowId": f"cli-ev-{unique}"}
        )).json()["executions"]
    ]  # fmt: skip
    last = (await client.get(f"/api/executions/{execution_id}")).json()["lastEventId"]
    assert last > 1000, "more than one page"

    listed = await flowcast("events", execution_id, url=url)
    assert listed.code == 0, listed.err
    lines = listed.out.splitlines()
    assert [int(line.split()[0]) for line in lines] == list(range(1, last + 1))
    first = lines[0].split()
    assert first[2] == "execution:started" and first[1].startswith("20"), "id, time, type"
    assert lines[-1].split()[2] == "execution:completed"

    as_json = json.loads((await flowcast("events", execution_id, "-o", "json", url=url)).out)
    assert [e["id"] for e in as_json["events"]] == list(range(1, last + 1))
    assert as_json["events"][0]["data"]["input"] is None, "the payloads, whole"
    assert (as_json["status"], as_json["lastEventId"], as_json["nextAfter"]) == (
        "completed", last, last
    )  # fmt: skip
    tail = json.loads(
        (
            await flowcast("events", execution_id, "--after", str(last - 2), "-o", "json", url=url)
        ).out
    )
    assert [e["id"] for e in tail["events"]] == [last - 1, last]


@pytest.mark.timeout(60)
async def test_approve_and_reject_with_flags_build_the_answer_from_the_schema(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    first = await _paused(client, f"cli-ap-{unique}", REVIEW)
    missing = await flowcast("approve", first, "--no-input", url=url)
    assert (
        missing.code == 2 and "'priority' is required: give it with --set priority=" in missing.err
    )
    wrong = await flowcast("approve", first, "--set", "priority=soon", url=url)
    assert wrong.code == 2 and "priority must be one of: low, high" in wrong.err
    assert (await client.get(f"/api/executions/{first}")).json()["status"] == "paused"

    approved = await flowcast(
        "approve", first, "--set", "priority=high", "--note", "fine", url=url
    )  # stdin is not a terminal here: nothing is asked
    assert (approved.code, approved.out.split()) == (0, [first, "running"]), approved.err
    assert await _answer_of(client, first) == {
        "approved": True, "priority": "high", "note": "fine", "count": 3
    }  # fmt: skip

    second = await _paused(client, f"cli-ap-{unique}", REVIEW)
    rejected = await flowcast(
        "reject", second, "--set", "priority=low", "--set", "count=7", url=url
    )
    assert rejected.code == 0, rejected.err
    assert await _answer_of(client, second) == {"approved": False, "priority": "low", "count": 7}

    finished = await flowcast("approve", second, "--set", "priority=low", url=url)
    assert finished.code == 2 and "is completed, not paused; nothing sent" in finished.err

    no_schema = await _paused(client, f"cli-ns-{unique}", {})
    answered = await flowcast("reject", no_schema, "--note", "no thanks", url=url)
    assert answered.code == 0, answered.err
    assert await _answer_of(client, no_schema) == {"approved": False, "note": "no thanks"}

    other = {"type": "object", "properties": {"level": {"type": "integer"}}}
    undecided = await _paused(client, f"cli-nd-{unique}", other)
    cannot = await flowcast("reject", undecided, url=url)
    assert cannot.code == 2 and "no boolean 'approved'" in cannot.err
    assert f"resume {undecided} --input" in cannot.err
    refused = await flowcast("approve", undecided, "--input", '{"level": "x"}', url=url)
    assert refused.code == 2 and "(422 " in refused.err, "the server checks the schema"


@pytest.mark.timeout(60)
async def test_approve_at_a_terminal_asks_each_field_of_the_schema(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    execution_id = await _paused(client, f"cli-tty-ap-{unique}", REVIEW)
    code, shown = await on_a_terminal(
        ["approve", execution_id, "--url", url],
        [
            ("priority [low/high] — how soon: ", "urgent\r"),
            ("priority must be one of: low, high", "high\r"),
            ("count (integer) (default 3): ", "two\r"),
            ("count must be a whole number", "\r"),
            ("note (string) (optional, Enter to skip): ", "looks right\r"),
        ],
    )
    assert code == 0, shown
    assert "paused at block 'ask': Ship?" in shown
    assert "approved" not in shown.split("Ship?")[1].split("answered")[0], "not asked: approve is"
    assert f"{execution_id} running" in shown
    assert await _answer_of(client, execution_id) == {
        "approved": True, "priority": "high", "count": 3, "note": "looks right"
    }  # fmt: skip


@pytest.mark.timeout(60)
async def test_ctrl_c_at_the_prompt_sends_nothing(client: httpx.AsyncClient, unique: str) -> None:
    url = str(client.base_url)
    execution_id = await _paused(client, f"cli-tty-cc-{unique}", REVIEW)
    code, shown = await on_a_terminal(
        ["reject", execution_id, "--url", url], [("priority [low/high]", CTRL_C)]
    )
    assert code == 130, shown
    assert "no answer given; nothing sent" in shown
    assert (await client.get(f"/api/executions/{execution_id}")).json()["status"] == "paused"


@pytest.mark.timeout(60)
async def test_secrets_set_list_and_delete_never_show_a_value(
    client: httpx.AsyncClient, unique: str
) -> None:
    url = str(client.base_url)
    name, value = f"CLI_{unique.upper()}", f"sk-{unique}-piped"
    created = await piped("secrets", "set", name, url=url, stdin=f"{value}\n".encode())
    assert (created.code, created.out) == (0, f"{name} created\n"), created.err

    listed = await flowcast("secrets", "list", url=url)
    assert listed.code == 0, listed.err
    assert listed.out.splitlines()[0].split() == ["NAME", "UPDATED"]
    assert any(line.split()[0] == name for line in listed.out.splitlines()[1:])
    as_json = json.loads((await flowcast("secrets", "list", "-o", "json", url=url)).out)
    (mine,) = [s for s in as_json["secrets"] if s["name"] == name]
    assert set(mine) == {"name", "updatedAt"}

    typed = f"sk-{unique}-typed"
    code, shown = await on_a_terminal(
        ["secrets", "set", name, "--url", url], [(f"value of {name} (not shown): ", f"{typed}\r")]
    )
    assert code == 0, shown
    assert f"{name} replaced" in shown
    assert typed not in shown, "the value is not echoed"

    short, empty, helped = await asyncio.gather(
        piped("secrets", "set", name, url=url, stdin=b"short"),
        piped("secrets", "set", name, url=url, stdin=b""),
        flowcast("secrets", "set", "--help", url=None),
    )
    assert short.code == 2 and "(422 " in short.err and "short" not in short.out
    assert empty.code == 2 and "the value is empty; nothing stored" in empty.err
    help_text = helped.out
    assert "never from the command line" in " ".join(help_text.split())

    deleted = await flowcast("secrets", "delete", name, url=url)
    assert (deleted.code, deleted.out) == (0, f"{name} deleted\n"), deleted.err
    again = await flowcast("secrets", "delete", name, url=url)
    assert again.code == 2 and "not found" in again.err
    for result in (created, listed, deleted, again):
        assert value not in result.out + result.err and typed not in result.out + result.err


@pytest.mark.timeout(60)
async def test_list_prints_json_with_o_json(client: httpx.AsyncClient, unique: str) -> None:
    url = str(client.base_url)
    await put(client, streaming_workflow(f"cli-lj-{unique}", words=2))
    ran = await flowcast("run", f"cli-lj-{unique}", url=url)
    listed = await flowcast("list", "--workflow", f"cli-lj-{unique}", "-o", "json", url=url)
    assert listed.code == 0, listed.err
    (row,) = json.loads(listed.out)["executions"]
    assert row["id"] == ran.out.splitlines()[0].split()[1] and row["status"] == "completed"


@pytest.mark.timeout(60)
async def test_the_new_commands_exit_5_when_the_server_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    commands = [
        ["workflows", "list"], ["describe", "ex_x"], ["events", "ex_x"],
        ["approve", "ex_x"], ["secrets", "list"], ["secrets", "delete", "NAME"],
    ]  # fmt: skip
    # At once: each spends its time in the client's backoff between retries.
    results = await asyncio.gather(*(flowcast(*command, url=url) for command in commands))
    for command, result in zip(commands, results, strict=True):
        assert result.code == 5, (command, result.err)
        assert "cannot reach the server" in result.err
