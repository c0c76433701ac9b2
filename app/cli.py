"""The ``flowcast`` command line: ``serve``, ``worker``, ``demo-model``, ``run``,
``attach``, ``resume``, ``cancel``, ``list`` here; ``workflows``, ``describe``,
``events``, ``approve``, ``reject`` and ``secrets`` in ``app.cli_resources``.

Exit codes: 0 completed (or the request was accepted), 1 failed, 2 usage or bad input
(a 4xx answer; the server's message goes to stderr), 3 cancelled, 4 paused (``run`` and
``attach`` stop at a pause unless ``--wait``), 5 the server could not be reached or could
not serve the request (a 5xx answer, or a stream that kept failing): worth a retry later,
unlike a 2.

``--url`` and ``--api-key`` go before or after the command (``flowcast --url U run wf``
and ``flowcast run wf --url U``); after it wins.
"""

from __future__ import annotations

import argparse
import errno
import functools
import ipaddress
import json
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.cli_answer import decides
from app.client import (
    DEFAULT_URL,
    Event,
    Finished,
    FlowcastClient,
    Gap,
    Queued,
    Reconnecting,
    Refused,
    Unreachable,
)
from app.progress import (
    Display,
    LiveDisplay,
    PlainDisplay,
    compact,
    created_ms,
    queued_text,
)

if TYPE_CHECKING:
    from app.settings import Settings

COMPLETED, FAILED, USAGE, CANCELLED, PAUSED, UNREACHABLE = 0, 1, 2, 3, 4, 5
INTERRUPTED = 130
OUTCOMES = {"completed": COMPLETED, "failed": FAILED, "cancelled": CANCELLED}


# Connections a storm of opens may queue before this process accepts them (uvicorn's
# default is 2048; the kernel caps it at net.core.somaxconn). Step 16's review: 5,000
# SSE opens at once overflowed the queue 24,000 times and 113 connections were reset.
BACKLOG = 16384


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> int:
    """Run one Flowcast process (embedded engine unless FLOWCAST_REDIS_URL is set)."""
    return _run_server(args, "app.main:create_app")


def worker(args: argparse.Namespace) -> int:
    """Run a process that only runs work: it takes queued executions for its
    ``FLOWCAST_WORKER_SLOTS`` and serves ``/healthz``, ``/readyz`` and ``/metrics``."""
    return _run_server(args, "app.main:create_worker", worker=True)


def demo_model(args: argparse.Namespace) -> int:
    """Serve the offline demo model (app/demo_model.py) until Ctrl-C."""
    sock = _listening(args.host, args.port, how="pick another port with --port N")
    if sock is None:
        return USAGE
    import uvicorn

    from app.demo_model import create_demo_app

    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{args.port}/v1"
    print(
        f"flowcast: an offline demo model (no real model behind it) at {url}\n"
        f"flowcast: point a server at it with FLOWCAST_LLM_BASE_URL={url}",
        file=sys.stderr,
        flush=True,
    )
    app = create_demo_app(words_per_second=args.words_per_second)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0 if server.started else 3


def _settings() -> Settings | None:
    """The settings from the environment, or None once each problem was said."""
    # The server's imports here, not at the top: the client commands (run, list, ...)
    # start in about half the time without them (and without uvicorn's, below).
    from pydantic import ValidationError

    from app.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        for problem in exc.errors():
            message = str(problem["msg"])
            if message.startswith("Value error, "):  # ours: it names the setting itself
                _error(message.removeprefix("Value error, "))
            else:
                name = "_".join(str(part) for part in problem["loc"]).upper()
                _error(f"FLOWCAST_{name}: {message}")
        return None


def _run_server(args: argparse.Namespace, factory: str, *, worker: bool = False) -> int:
    settings = _settings()
    if settings is None:
        return USAGE
    if worker and settings.worker_slots == 0:
        from app.settings import NO_SLOTS

        _error(NO_SLOTS)
        return USAGE
    host = args.host or settings.host
    port = args.port if args.port is not None else settings.port
    if not settings.api_keys and not _is_loopback(host):
        print(
            f"flowcast: refusing to listen on {host} without FLOWCAST_API_KEYS; "
            "without keys the API is open, so it binds to 127.0.0.1 only",
            file=sys.stderr,
        )
        return 2
    # Bound before anything starts (the engine, Redis clients, the runner): a port in use
    # was an Errno 98 traceback once all of it had started (step 18, issue 26).
    sock = _listening(host, port)
    if sock is None:
        return USAGE
    if not settings.api_keys:
        print("flowcast: no FLOWCAST_API_KEYS set; listening on loopback only", file=sys.stderr)
    import uvicorn

    config = uvicorn.Config(
        factory,
        factory=True,
        host=host,
        port=port,
        log_config=None,
        timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) + 5,
        backlog=BACKLOG,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # as uvicorn.run: Ctrl-C before the server took over its signals
    finally:
        sock.close()
    # As uvicorn.run: a start that failed (its lifespan raised) exits 3.
    return 0 if server.started else 3


def _listening(
    host: str, port: int, *, how: str = "pick another port with --port N or FLOWCAST_PORT=N"
) -> socket.socket | None:
    """A socket bound to ``host:port`` as uvicorn binds one (it listens on it), or None
    once the reason was said in one line (``how`` says how to pick another port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # As uvicorn does: a port left in TIME_WAIT by a server just stopped is free again.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if isinstance(exc, socket.gaierror):
            _error(f"cannot listen on {host}: {exc.strerror}; set --host or FLOWCAST_HOST")
        elif exc.errno == errno.EADDRINUSE:
            _error(f"port {port} on {host} is already in use; {how}")
        elif exc.errno == errno.EADDRNOTAVAIL:
            _error(
                f"cannot listen on {host}: it is no address of this machine; "
                "set --host or FLOWCAST_HOST"
            )
        else:
            _error(f"cannot listen on {host}:{port}: {exc.strerror or exc}; {how}")
        return None
    return sock


def _error(text: str) -> None:
    print(f"flowcast: {text}", file=sys.stderr, flush=True)


def _json_argument(raw: str) -> Any:
    """``--input`` as JSON, or ``@path`` for a file holding the JSON."""
    text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
    return json.loads(text)


def _display(args: argparse.Namespace) -> Display | None:
    if args.quiet:
        return None
    if args.plain or not sys.stdout.isatty():
        return PlainDisplay()
    return LiveDisplay()


def _program() -> str:
    """How to run this command again, for the hints: ``flowcast`` when that is what the
    shell finds, else the path it was started by (e.g. ``.venv/bin/flowcast``)."""
    started = sys.argv[0]
    if Path(started).name != "flowcast":
        return "flowcast"  # python -m app.cli, tests, …
    found = shutil.which("flowcast")
    if found and Path(found).resolve() == Path(started).resolve():
        return "flowcast"
    return shlex.quote(started)


def _show_pause(execution_id: str, pause: dict[str, Any], after: int) -> None:
    block = pause.get("blockId", "")
    program = _program()
    _error(f"paused at block {block!r}: {pause.get('prompt', '')}")
    if pause.get("schema"):
        _error(f"the answer must match: {compact(pause['schema'])}")
    if decides(pause.get("schema")):
        _error(f"approve it with: {program} approve {execution_id}  (or reject)")
    _error(f"resume it with: {program} resume {execution_id} --block {block} --input '<JSON>'")
    _error(f"then follow it with: {program} attach {execution_id} --after {after}")


def _finish(status: str, data: dict[str, Any]) -> int:
    """Print the outcome of a finished execution (from its terminal event or snapshot)."""
    if status == "completed":
        output = data.get("output")
        print(json.dumps(output, indent=2) if sys.stdout.isatty() else compact(output), flush=True)
    elif status == "failed":
        error = data.get("error") or {}
        where = f" in block {error['blockId']!r}" if error.get("blockId") else ""
        _error(f"execution failed{where}: {error.get('code')}: {error.get('message')}")
    elif status == "cancelled":
        _error("execution cancelled")
    return OUTCOMES[status]


def _follow(
    client: FlowcastClient, execution_id: str, *, after: int, wait: bool, display: Display | None
) -> int:
    """Follow the execution to its end (or its pause); the exit code of what happened."""
    cursor = after
    try:
        for item in client.follow(execution_id, after=after):
            if isinstance(item, Event):
                cursor = item.id
                if display:
                    display.event(item)
                if item.terminal_status:
                    if display:
                        display.close()
                    # The event, not a snapshot: live events can arrive before the
                    # snapshot shows them.
                    return _finish(item.terminal_status, item.data)
                if item.type == "execution:paused" and not wait:
                    # A replayed pause may have been answered since: stop unless later
                    # events exist (the snapshot may lag a live pause, never lead it),
                    # or its answer waits in line for a worker (queued).
                    snapshot = client.execution(execution_id)
                    if snapshot["status"] == "queued":
                        if display:
                            display.queued(int(snapshot.get("ahead") or 0))
                    elif snapshot["lastEventId"] <= item.id:
                        if display:
                            display.close()
                        _show_pause(execution_id, item.data, item.id)
                        return PAUSED
            elif isinstance(item, Gap) and display:
                display.gap(item)
            elif isinstance(item, Queued) and display:
                display.queued(item.ahead)
            elif isinstance(item, Reconnecting) and display:
                display.notice(
                    f"stream ended ({item.reason}); reconnecting after event {item.cursor}"
                    + (f" in {item.delay:.1f}s" if item.delay else "")
                )
            elif isinstance(item, Finished):
                snapshot = client.execution(execution_id)
                if display:
                    display.close()
                return _finish(snapshot["status"], snapshot)
    except KeyboardInterrupt:
        if display:
            display.close()
        # Leaving never cancels the execution; say how to come back.
        _error(
            f"stopped following; attach again with: "
            f"{_program()} attach {execution_id} --after {cursor}"
        )
        return INTERRUPTED
    finally:
        # Whatever ends the loop (an error, Ctrl-C), the terminal gets its cursor back
        # before anything else is printed.
        if display:
            display.close()
    raise AssertionError("the stream ended without a terminal event")


def _client(args: argparse.Namespace) -> FlowcastClient:
    return FlowcastClient(args.url, api_key=args.api_key)


def run(args: argparse.Namespace) -> int:
    """Start an execution and follow it."""
    with _client(args) as client:
        started = client.execute(args.workflow, input=args.input, inline_files=args.inline_files)
        execution_id = started["executionId"]
        display = _display(args)
        if display:
            display.started(execution_id, args.workflow)
            if started.get("status") == "queued":
                display.queued(int(started.get("ahead") or 0))
        return _follow(client, execution_id, after=0, wait=args.wait, display=display)


def attach(args: argparse.Namespace) -> int:
    """Follow an existing execution."""
    with _client(args) as client:
        snapshot = client.execution(args.execution)
        paused = snapshot["status"] == "paused" and args.after >= snapshot["lastEventId"]
        if paused and not args.wait:
            _show_pause(args.execution, snapshot.get("pause") or {}, snapshot["lastEventId"])
            return PAUSED
        display = _display(args)
        if display:
            display.started(args.execution, snapshot["workflowId"], snapshot.get("createdAt"))
            if snapshot["status"] == "queued":
                display.queued(int(snapshot.get("ahead") or 0))
        return _follow(client, args.execution, after=args.after, wait=args.wait, display=display)


def resume(args: argparse.Namespace) -> int:
    """Answer a pause."""
    with _client(args) as client:
        answer = client.resume(args.execution, input=args.input, block_id=args.block)
    print(f"{answer['executionId']} {answer['status']}", flush=True)
    return COMPLETED


def cancel(args: argparse.Namespace) -> int:
    """Cancel a queued, running or paused execution."""
    with _client(args) as client:
        answer = client.cancel(args.execution)
    print(f"{answer['executionId']} {answer['status']}", flush=True)
    return COMPLETED


def _print_json(value: Any) -> None:
    """``-o json``: indented on a terminal, one line otherwise (for pipes and scripts)."""
    if sys.stdout.isatty():
        print(json.dumps(value, indent=2, ensure_ascii=False), flush=True)
    else:
        print(compact(value), flush=True)


def _table(rows: Sequence[Sequence[str]]) -> None:
    """Rows in columns as wide as their widest cell."""
    if not rows:
        return
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
    sys.stdout.flush()


def list_executions(args: argparse.Namespace) -> int:
    """Recent executions as a table, newest first."""
    with _client(args) as client:
        found = client.executions(workflow_id=args.workflow, status=args.status, limit=args.limit)
    if args.output == "json":
        _print_json({"executions": found})
        return COMPLETED
    rows = [("ID", "WORKFLOW", "STATUS", "EVENTS", "CREATED", "UPDATED", "DURATION")]
    rows += [
        (e["id"], e["workflowId"], _status(e), str(e["lastEventId"]), e["createdAt"],
         e["updatedAt"], _duration(e))
        for e in found
    ]  # fmt: skip
    _table(rows)
    return COMPLETED


def _status(execution: dict[str, Any]) -> str:
    """A listed execution's status; a queued one with its place (``queued, 3 ahead``),
    one a person rejected an approval of with it (``completed,rejected``)."""
    if execution["status"] == "queued" and execution.get("ahead") is not None:
        return queued_text(int(execution["ahead"]))
    if execution.get("decision") == "rejected":
        return f"{execution['status']},rejected"
    return str(execution["status"])


def _duration(execution: dict[str, Any]) -> str:
    """A finished execution's duration, ``createdAt`` to its end (its ``updatedAt``, the
    terminal event's time), as every view shows it (``7.6s``); ``-`` while unfinished."""
    if execution["status"] not in OUTCOMES:
        return "-"
    created, ended = created_ms(execution.get("createdAt")), created_ms(execution.get("updatedAt"))
    if created is None or ended is None:
        return "?"
    return f"{max(0.0, ended - created) / 1000:.1f}s"


def _client_options(command: argparse.ArgumentParser, *, top: bool) -> None:
    """``--url`` and ``--api-key``, on the top parser (with the defaults) and on each
    client command (without: a value given after the command replaces the one before,
    and a missing one leaves it alone)."""
    command.add_argument(
        "--url",
        default=(os.environ.get("FLOWCAST_URL") or DEFAULT_URL) if top else argparse.SUPPRESS,
        help=f"the server (default FLOWCAST_URL or {DEFAULT_URL})",
    )
    command.add_argument(
        "--api-key",
        default=(os.environ.get("FLOWCAST_API_KEY") or None) if top else argparse.SUPPRESS,
        help="sent as a Bearer token (default FLOWCAST_API_KEY)",
    )


def _follow_options(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--wait", action="store_true", help="keep following through pauses instead of exiting 4"
    )
    shown = command.add_mutually_exclusive_group()
    shown.add_argument("--plain", action="store_true", help="one line per event, even on a TTY")
    shown.add_argument("-q", "--quiet", action="store_true", help="print only the output")


def _json_type(raw: str) -> Any:
    try:
        return _json_argument(raw)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="flowcast", description="Flowcast: its server, and a client for its API."
    )
    _client_options(top, top=True)
    commands = top.add_subparsers(dest="command", required=True)
    run_server = commands.add_parser("serve", help="run the server")
    run_server.add_argument("--host", help="listen address (default FLOWCAST_HOST or 127.0.0.1)")
    run_server.add_argument("--port", type=int, help="listen port (default FLOWCAST_PORT or 8000)")
    run_server.set_defaults(handler=serve)

    run_worker = commands.add_parser(
        "worker", help="run a process that only runs queued work (no API)"
    )
    run_worker.add_argument(
        "--host", help="where /healthz, /readyz and /metrics listen (default FLOWCAST_HOST)"
    )
    run_worker.add_argument("--port", type=int, help="their port (default FLOWCAST_PORT or 8000)")
    run_worker.set_defaults(handler=worker)

    demo = commands.add_parser(
        "demo-model",
        help="serve an offline OpenAI-compatible demo model for the llm examples",
    )
    demo.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    demo.add_argument("--port", type=int, default=11435, help="listen port (default 11435)")
    demo.add_argument(
        "--words-per-second",
        type=float,
        default=20.0,
        help="pace of streamed replies (default 20; 0 sends them at once)",
    )
    demo.set_defaults(handler=demo_model)

    start = commands.add_parser("run", help="start an execution and follow it")
    start.add_argument("workflow", help="workflow id")
    start.add_argument("--input", type=_json_type, help="input as JSON, or @file")
    start.add_argument(
        "--inline-files", action="store_true", help="keep file values' content inline"
    )
    _follow_options(start)
    start.set_defaults(handler=run)

    follow = commands.add_parser("attach", help="follow an existing execution")
    follow.add_argument("execution", metavar="EID", help="execution id")
    follow.add_argument("--after", type=int, default=0, help="start after this event id")
    _follow_options(follow)
    follow.set_defaults(handler=attach)

    answer = commands.add_parser("resume", help="answer a paused execution")
    answer.add_argument("execution", metavar="EID", help="execution id")
    answer.add_argument("--input", type=_json_type, required=True, help="answer as JSON, or @file")
    answer.add_argument("--block", help="the paused block's id (refused if paused elsewhere)")
    answer.set_defaults(handler=resume)

    stop = commands.add_parser("cancel", help="cancel a queued, running or paused execution")
    stop.add_argument("execution", metavar="EID", help="execution id")
    stop.set_defaults(handler=cancel)

    recent = commands.add_parser("list", help="recent executions")
    recent.add_argument("--workflow", help="only this workflow's")
    recent.add_argument("--status", help="only in this status")
    recent.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    recent.set_defaults(handler=list_executions)
    for command in (start, follow, answer, stop, recent):
        _client_options(command, top=False)
    # Here, not at the top: that module reads this one's helpers.
    from app import cli_resources

    cli_resources.output_option(recent)
    cli_resources.add_commands(commands, functools.partial(_client_options, top=False))
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        result: int = args.handler(args)
    except Refused as exc:
        _error(f"{exc.message} ({exc.status} {exc.code})")
        for problem in (exc.body or {}).get("error", {}).get("problems", []):
            _error(f"  {problem.get('path')}: {problem.get('message')}")
        # A 5xx means this server cannot serve the request now (e.g. its buffer is down).
        return USAGE if exc.status < 500 else UNREACHABLE
    except Unreachable as exc:
        _error(exc.message)
        return UNREACHABLE
    except KeyboardInterrupt:
        return INTERRUPTED
    return result


if __name__ == "__main__":
    sys.exit(main())
