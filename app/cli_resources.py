"""The ``flowcast`` commands for the API's resources besides running: ``workflows
list/show/apply/delete``, ``describe EID``, ``events EID``, ``approve``/``reject EID``
and ``secrets list/set/delete``.

Listings print a table, or with ``-o json`` the API's answer unchanged (``describe``
adds the run's ``input``; ``events`` joins every page into one). Changes print one line,
``<name> <what happened>``. Exit codes and errors are ``app.cli``'s: 2 for a 4xx answer
(the server's message on stderr), 5 when the server cannot serve.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from app import cli_answer
from app.cli import (
    COMPLETED,
    INTERRUPTED,
    USAGE,
    _client,
    _error,
    _json_type,
    _print_json,
    _program,
    _table,
)
from app.client import Event, FlowcastClient
from app.progress import compact, describe

PAGE = 1000
TERMINAL = {"completed", "failed", "cancelled"}


def _is_json(args: argparse.Namespace) -> bool:
    return bool(args.output == "json")


# -- workflows ---------------------------------------------------------------------------


def workflows_list(args: argparse.Namespace) -> int:
    """The workflows this key sees."""
    with _client(args) as client:
        found = client.workflows()
    if _is_json(args):
        _print_json({"workflows": found})
        return COMPLETED
    rows = [("ID", "NAME", "BLOCKS", "SOURCE")]
    rows += [(w["id"], w.get("name") or "", str(w["blocks"]), w["source"]) for w in found]
    _table(rows)
    return COMPLETED


def workflows_show(args: argparse.Namespace) -> int:
    """One workflow: its blocks and edges (``-o json``: its document)."""
    with _client(args) as client:
        document = client.workflow(args.workflow)
    if _is_json(args):
        _print_json(document)
        return COMPLETED
    for label, key in (("id", "id"), ("name", "name"), ("description", "description")):
        if document.get(key):
            print(f"{label + ':':<13}{document[key]}")
    print(f"{'source:':<13}{document.get('source', '')}")
    blocks = document.get("blocks") or []
    print(f"blocks ({len(blocks)}):")
    _table([(f"  {b['id']}", b["type"]) for b in blocks])
    edges = document.get("edges") or []
    if edges:
        print(f"edges ({len(edges)}):")
        for edge in edges:
            when = f"  when {edge['when']}" if edge.get("when") else ""
            print(f"  {edge['from']} → {edge['to']}{when}")
    return COMPLETED


def workflows_apply(args: argparse.Namespace) -> int:
    """Create or replace the workflow a JSON file holds (``-`` for stdin)."""
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        document = json.loads(text)
    except (OSError, ValueError) as exc:
        _error(f"cannot read a workflow from {args.file}: {exc}")
        return USAGE
    if isinstance(document, dict):
        # What `workflows show -o json` prints says where the workflow came from; the
        # server reports it, never takes it.
        document.pop("source", None)
        if args.id:
            document["id"] = args.id  # a copy under another id
        workflow_id = document.get("id")
    else:
        workflow_id = args.id
    if not isinstance(workflow_id, str) or not workflow_id:
        _error(f'{args.file} has no "id": give one with --id')
        return USAGE
    with _client(args) as client:
        _, created = client.put_workflow(workflow_id, document)
    print(f"{workflow_id} {'created' if created else 'replaced'}", flush=True)
    return COMPLETED


def workflows_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_workflow(args.workflow)
    print(f"{args.workflow} deleted", flush=True)
    return COMPLETED


# -- one execution -----------------------------------------------------------------------


def _input(client: FlowcastClient, snapshot: dict[str, Any]) -> tuple[bool, Any]:
    """The run's input (from ``execution:started``, event 1), and whether it is known:
    not once the ring evicted that event."""
    if "input" in snapshot:
        return True, snapshot["input"]
    if snapshot.get("firstRetainedEventId", 1) > 1 or snapshot.get("lastEventId", 0) < 1:
        return False, None
    events = client.events(snapshot["id"], after=0, limit=1)["events"]
    if events and events[0]["type"] == "execution:started":
        return True, (events[0].get("data") or {}).get("input")
    return False, None


def _duration(snapshot: dict[str, Any]) -> str:
    """From ``createdAt`` to now (or to the end, once finished: ``updatedAt`` is the
    terminal event's time)."""
    try:
        start = datetime.fromisoformat(snapshot["createdAt"])
        end = (
            datetime.fromisoformat(snapshot["updatedAt"])
            if snapshot["status"] in TERMINAL
            else datetime.now(start.tzinfo)
        )
    except (KeyError, TypeError, ValueError):
        return "?"
    took = f"{(end - start).total_seconds():.2f}s"
    return took if snapshot["status"] in TERMINAL else f"{took} so far"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def describe_execution(args: argparse.Namespace) -> int:
    """An execution's snapshot, with its input and output."""
    with _client(args) as client:
        snapshot = client.execution(args.execution)
        known, given = _input(client, snapshot)
    if _is_json(args):
        _print_json({**snapshot, "input": given} if known else snapshot)
        return COMPLETED
    status = snapshot["status"]
    if status == "queued" and snapshot.get("ahead") is not None:
        status = f"queued, {snapshot['ahead']} ahead"
    pause = snapshot.get("pause")
    if status == "paused" and pause:
        status = f"paused at block {pause.get('blockId')!r}: {pause.get('prompt', '')}"
    first, last = snapshot.get("firstRetainedEventId", 1), snapshot["lastEventId"]
    events = f"{last}" + (f" (1-{first - 1} no longer retained)" if first > 1 else "")
    for label, value in (
        ("id", snapshot["id"]),
        ("workflow", snapshot["workflowId"]),
        ("status", status),
        ("created", snapshot["createdAt"]),
        ("updated", snapshot["updatedAt"]),
        ("duration", _duration(snapshot)),
        ("events", events),
    ):
        print(f"{label + ':':<10}{value}")
    if status.startswith("paused") and pause:
        if pause.get("schema"):
            print(f"{'answer:':<10}{compact(pause['schema'])}")
        print(f"{'':<10}{_program()} approve {snapshot['id']}  (or reject)")
    if snapshot.get("error"):
        error = snapshot["error"]
        where = f" in block {error['blockId']!r}" if error.get("blockId") else ""
        print(f"{'error:':<10}{error.get('code')}{where}: {error.get('message')}")
    print("input:", _pretty(given) if known else "(no longer retained)")
    if "output" in snapshot:
        print("output:", _pretty(snapshot["output"]))
    return COMPLETED


def events(args: argparse.Namespace) -> int:
    """The execution's stored events after ``--after``, every page (it does not follow:
    ``attach`` does)."""
    found: list[dict[str, Any]] = []
    after = args.after
    with _client(args) as client:
        while True:
            page = client.events(args.execution, after=after, limit=PAGE)
            found += page["events"]
            if not page["events"] or page["nextAfter"] >= page["lastEventId"]:
                break
            after = page["nextAfter"]
    if _is_json(args):
        _print_json({**page, "events": found, "nextAfter": found[-1]["id"] if found else after})
        return COMPLETED
    cursor = args.after
    for envelope in found:
        if envelope["id"] > cursor + 1:  # as `attach` says it: these ids are gone
            why = "evicted" if envelope["id"] <= page["firstRetainedEventId"] else "dropped"
            print(f"gap after={cursor} resumeAt={envelope['id']} reason={why}")
        event = Event(envelope["id"], envelope["type"], envelope.get("data") or {}, envelope)
        print(f"{event.id} {envelope.get('ts', '')} {event.type} {describe(event)}".rstrip())
        cursor = event.id
    return COMPLETED


# -- answers -----------------------------------------------------------------------------


def approve(args: argparse.Namespace) -> int:
    return _answer(args, approved=True)


def reject(args: argparse.Namespace) -> int:
    return _answer(args, approved=False)


def _answer(args: argparse.Namespace, *, approved: bool) -> int:
    """Answer the execution's pause from its schema (asked at a terminal)."""
    with _client(args) as client:
        snapshot = client.execution(args.execution)
        pause = snapshot.get("pause") or {}
        if snapshot["status"] != "paused":
            _error(f"execution {args.execution} is {snapshot['status']}, not paused; nothing sent")
            return USAGE
        block = pause.get("blockId")
        ask = None if args.no_input or not sys.stdin.isatty() else cli_answer.terminal_ask
        if ask:
            _error(f"paused at block {block!r}: {pause.get('prompt', '')}")
        try:
            answer = cli_answer.build(
                pause.get("schema"),
                approved=approved,
                given=args.input,
                settings=args.set,
                note=args.note,
                ask=ask,
            )
        except cli_answer.NoAnswer as exc:
            _error(f"{exc}; nothing sent")
            if not approved and not cli_answer.decides(pause.get("schema")):
                _error(f"answer it with: {_program()} resume {args.execution} --input '<JSON>'")
            return USAGE
        except (KeyboardInterrupt, EOFError):
            print(file=sys.stderr)
            _error("no answer given; nothing sent")
            return INTERRUPTED
        sent = client.resume(args.execution, input=answer, block_id=block)
    _error(f"answered block {block!r} with {compact(answer)}")
    print(f"{sent['executionId']} {sent['status']}", flush=True)
    return COMPLETED


# -- secrets -----------------------------------------------------------------------------


def secrets_list(args: argparse.Namespace) -> int:
    """The tenant's secret names (no route ever returns a value)."""
    with _client(args) as client:
        found = client.secrets()
    if _is_json(args):
        _print_json({"secrets": found})
        return COMPLETED
    _table([("NAME", "UPDATED"), *((s["name"], s["updatedAt"]) for s in found)])
    return COMPLETED


def _secret_value(name: str) -> str | None:
    """The value, from a prompt that does not echo at a terminal, else from stdin (one
    trailing newline dropped, so ``echo "$TOKEN" | flowcast secrets set NAME`` works)."""
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass(f"value of {name} (not shown): ")
    value = sys.stdin.read()
    return value.removesuffix("\n").removesuffix("\r")


def secrets_set(args: argparse.Namespace) -> int:
    try:
        value = _secret_value(args.name)
    except (KeyboardInterrupt, EOFError):
        print(file=sys.stderr)
        _error("no value given; nothing stored")
        return INTERRUPTED
    if not value:
        _error("the value is empty; nothing stored")
        return USAGE
    with _client(args) as client:
        _, created = client.put_secret(args.name, value)
    print(f"{args.name} {'created' if created else 'replaced'}", flush=True)
    return COMPLETED


def secrets_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_secret(args.name)
    print(f"{args.name} deleted", flush=True)
    return COMPLETED


# -- the parsers -------------------------------------------------------------------------


def output_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "-o",
        "--output",
        choices=("text", "json"),
        default="text",
        help="text for people (default) or json: the API's answer as JSON",
    )


def add_commands(commands: Any, client_options: Any) -> None:
    """Add the commands to ``commands``; ``client_options(parser)`` adds --url/--api-key."""
    made: list[argparse.ArgumentParser] = []

    def command(
        group: Any, name: str, handler: Any, help: str, *, listing: bool = False
    ) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = group.add_parser(name, help=help, description=help)
        made.append(parser)
        parser.set_defaults(handler=handler)
        if listing:
            output_option(parser)
        return parser

    flows = commands.add_parser("workflows", help="list, show, apply or delete workflows")
    flow = flows.add_subparsers(dest="action", required=True, metavar="ACTION")
    command(flow, "list", workflows_list, "the workflows this key sees", listing=True)
    show = command(flow, "show", workflows_show, "one workflow's blocks and edges", listing=True)
    show.add_argument("workflow", metavar="ID", help="workflow id")
    apply = command(flow, "apply", workflows_apply, "create or replace a workflow from a file")
    apply.add_argument("file", metavar="FILE", help="the workflow as JSON (- for stdin)")
    apply.add_argument("--id", help="store it under this id (default: the document's id)")
    delete = command(flow, "delete", workflows_delete, "delete a workflow stored by the API")
    delete.add_argument("workflow", metavar="ID", help="workflow id")

    about = command(
        commands, "describe", describe_execution, "an execution's status, input and output",
        listing=True,
    )  # fmt: skip
    about.add_argument("execution", metavar="EID", help="execution id")
    history = command(
        commands, "events", events, "an execution's stored events (without following)",
        listing=True,
    )  # fmt: skip
    history.add_argument("execution", metavar="EID", help="execution id")
    history.add_argument("--after", type=int, default=0, help="only the events after this id")

    for name, handler, verb in (("approve", approve, "yes"), ("reject", reject, "no")):
        answer = command(
            commands, name, handler,
            f"answer a paused execution {verb}, asking its schema's fields at a terminal",
        )  # fmt: skip
        answer.add_argument("execution", metavar="EID", help="execution id")
        answer.add_argument(
            "--set",
            action="append",
            metavar="NAME=VALUE",
            help="a field of the answer (repeatable), typed by the pause's schema",
        )
        answer.add_argument("--note", help="the answer's note (a field named note)")
        answer.add_argument(
            "--input", type=_json_type, help="the answer as JSON, or @file (fields added to it)"
        )
        answer.add_argument(
            "--no-input",
            action="store_true",
            help="never ask: use --set, --note, --input and the schema's defaults",
        )

    vault = commands.add_parser("secrets", help="list, set or delete the tenant's secrets")
    secret = vault.add_subparsers(dest="action", required=True, metavar="ACTION")
    command(secret, "list", secrets_list, "the secrets' names (never their values)", listing=True)
    store = command(
        secret, "set", secrets_set,
        "store a secret; its value is read from a prompt that does not echo, or from stdin "
        "when stdin is not a terminal (never from the command line, where shell history "
        "and ps would keep it)",
    )  # fmt: skip
    store.add_argument("name", metavar="NAME", help="the name templates read as secrets.NAME")
    forget = command(secret, "delete", secrets_delete, "delete a secret")
    forget.add_argument("name", metavar="NAME", help="secret name")
    for parser in made:
        client_options(parser)
