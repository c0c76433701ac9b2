"""Templates and ``when`` conditions evaluated off the event loop, under hard bounds.

``TemplatePool`` is what the executor renders with. A plain path (``{{ input.a }}``,
``{{ blocks.x.output['k'][0] }}``) and a string without template syntax are answered in
this process at once: they only look up JSON data. Anything else goes to one of a few
worker processes (``lib.workflows.worker``), each under its own address-space and CPU
limits. A template may use ``timeout_ms`` of CPU (the worker's own check, then a CPU
timer and the OS's CPU limit); the pool waits for its answer a few times that on the
wall clock, so a busy machine slows a trivial template without failing it. A worker
that overruns, runs out of memory in a way it cannot report, or answers too much is
killed and a fresh one is started on the next request, so one tenant's template costs
the others at most a worker for that long. Every failure past a bound is the
non-retryable BlockError ``template_error``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import pickle
import signal
import sys
from pathlib import Path
from typing import Any

import orjson

from lib.errors import BlockError
from lib.slices import size_past
from lib.workflows.templates import NOT_SIMPLE, is_template, lookup, plain_value
from lib.workflows.worker import HEADER, MiB

log = logging.getLogger(__name__)

# The wall-clock wait for an answer, past the CPU bound: only a worker that is not
# running at all (stopped, starved for seconds) reaches it.
WALL_FACTOR = 4
WALL_SLACK_SECONDS = 2.0


def wall_seconds(timeout_ms: int) -> float:
    """How long the pool waits for one answer of a template bounded to ``timeout_ms``
    of CPU."""
    return timeout_ms / 1000 * WALL_FACTOR + WALL_SLACK_SECONDS


# The directory that holds the ``lib`` package, so a worker imports this very code.
_ROOT = str(Path(__file__).resolve().parents[2])


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: a worker's reply never names a class."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a template worker sent {module}.{name}")


class _Overrun(Exception):
    """The worker broke a bound the pool enforces; it is killed."""


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def send(self, message: Any, timeout: float) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        stdin.write(HEADER.pack(len(data)) + data)
        async with asyncio.timeout(timeout):
            await stdin.drain()

    async def receive(self, timeout: float, max_bytes: int) -> Any:
        stdout = self.process.stdout
        assert stdout is not None
        async with asyncio.timeout(timeout):
            (size,) = HEADER.unpack(await stdout.readexactly(HEADER.size))
            if size > max_bytes:
                raise _Overrun(f"a template worker answered {size} bytes")
            body = await stdout.readexactly(size)
        return _PlainUnpickler(io.BytesIO(body)).load()

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


class TemplatePool:
    """Evaluates templates: plain paths here, everything else in bounded worker processes.

    Use as ``async with``; workers start when first needed and are stopped on close.
    """

    def __init__(
        self,
        *,
        size: int = 2,
        timeout_ms: int = 1000,
        max_output_bytes: int = MiB,
        memory_bytes: int = 64 * MiB,
        start_timeout_seconds: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self.timeout_ms = timeout_ms
        self.max_output_bytes = max_output_bytes
        self.memory_bytes = memory_bytes
        self.start_timeout_seconds = start_timeout_seconds
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()
        self._reaping: set[asyncio.Task[int]] = set()
        self._closed = False

    async def __aenter__(self) -> TemplatePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every worker; the pool refuses work afterwards."""
        self._closed = True
        for worker in list(self._workers):
            self._discard(worker)
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)

    @property
    def worker_pids(self) -> list[int]:
        """The running workers' process ids (for tests and metrics)."""
        return [worker.process.pid for worker in self._workers]

    async def render(self, value: Any, context: dict[str, Any]) -> Any:
        """Render every template inside a JSON value; other values come back unchanged.

        The output bound is on all the value's templates render to, every answer counted
        where it is used: a config of 300 ``"{{ input.s }}"`` with a 1 MB ``s`` built and
        stored 300 MB, each answer within the bound (step 16's review, row 3). Text that
        is no template is the workflow's own, bounded when it was stored."""
        answers: dict[str, Any] = {}
        pending: list[str] = []
        self._plan(value, context, answers, pending)
        sizes = _Sizes(self.max_output_bytes)
        await self._check_total(value, answers, sizes)  # before a worker is asked anything
        for source, found in answers.items():  # within the bound: cheap to make plain
            answers[source] = plain_value(found)
        if pending:
            results = await self._evaluate("render", pending, context)
            answers.update(zip(pending, results, strict=True))
            await self._check_total(value, answers, sizes)
        return _substitute(value, answers)

    async def _check_total(self, value: Any, answers: dict[str, Any], sizes: _Sizes) -> None:
        total = 0
        stack = [value]
        while stack:
            current = stack.pop()
            if isinstance(current, dict):
                stack.extend(current.values())
            elif isinstance(current, list):
                stack.extend(current)
            elif isinstance(current, str) and is_template(current):
                total += await sizes.of(answers.get(current, current))
            if total > self.max_output_bytes:
                raise BlockError(
                    "template_error",
                    f"the block's config renders to more than {self.max_output_bytes} bytes",
                    retryable=False,
                )

    async def condition(self, expr: str, context: dict[str, Any]) -> bool:
        """Evaluate an edge's ``when`` expression; undefined is false."""
        result = lookup(expr, context, braces=False)
        if result is NOT_SIMPLE:
            (verdict,) = await self._evaluate("condition", [expr], context)
            return bool(verdict)
        return result is not None and bool(result)

    def _plan(
        self, value: Any, context: dict[str, Any], answers: dict[str, Any], pending: list[str]
    ) -> None:
        """Answer the plain paths inside ``value``; list the templates left for a worker."""
        stack = [value]
        seen: set[str] = set()
        while stack:
            current = stack.pop()
            if isinstance(current, dict):
                stack.extend(current.values())
            elif isinstance(current, list):
                stack.extend(current)
            elif is_template(current) and current not in seen:
                seen.add(current)
                result = lookup(current, context, braces=True, plain=False)
                if result is NOT_SIMPLE:
                    pending.append(current)
                    continue
                if isinstance(result, str) and len(result.encode("utf-8", "surrogatepass")) > (
                    self.max_output_bytes
                ):
                    raise _too_large(self.max_output_bytes)
                answers[current] = result

    async def _evaluate(self, kind: str, sources: list[str], context: dict[str, Any]) -> list[Any]:
        """Evaluate ``sources`` in one worker: one answer each, or a BlockError."""
        if self._closed:
            raise BlockError("template_error", "the template pool is closed", retryable=True)
        timeout = wall_seconds(self.timeout_ms)
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._start()
            healthy = False
            try:
                results, error, recycle = await self._exchange(
                    worker, (kind, sources, context), timeout
                )
                healthy = not recycle
            except TimeoutError:
                message = f"the template took too long to evaluate (over {self.timeout_ms} ms)"
                raise BlockError("template_error", message, retryable=False) from None
            except (asyncio.IncompleteReadError, ConnectionError):
                raise await self._died(worker) from None
            except (_Overrun, pickle.UnpicklingError) as exc:
                log.warning("template worker %d stopped: %s", worker.process.pid, exc)
                raise _too_large(self.max_output_bytes) from None
            finally:
                if healthy and not self._closed:
                    self._idle.append(worker)
                else:
                    self._discard(worker)
        if error is not None:
            raise error
        return results

    async def _exchange(
        self, worker: _Worker, request: tuple[str, list[str], dict[str, Any]], timeout: float
    ) -> tuple[list[Any], BlockError | None, bool]:
        """Send one request; read each answer within ``timeout``, then the closing one."""
        # Writing a large context may wait for the worker to read it: not template time.
        await worker.send(request, timeout + self.start_timeout_seconds)
        max_bytes = 2 * self.max_output_bytes + 64 * 1024
        results: list[Any] = []
        error: BlockError | None = None
        while True:
            reply = await worker.receive(timeout, max_bytes)
            if reply[0] == "ok":
                results.append(reply[1])
            elif reply[0] == "error":
                error = BlockError(str(reply[1]), str(reply[2]), retryable=False)
            elif reply[0] == "done":
                return results, error, bool(reply[1])
            else:
                raise _Overrun(f"a template worker sent {reply[0]!r}")

    async def _start(self) -> _Worker:
        """Start a worker and wait until it says it is ready."""
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": _ROOT + (os.pathsep + path if path else "")}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lib.workflows.worker",
            "--timeout-ms", str(self.timeout_ms),
            "--max-bytes", str(self.max_output_bytes),
            "--memory-bytes", str(self.memory_bytes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        worker = _Worker(process)
        self._workers.add(worker)
        try:
            ready = await worker.receive(self.start_timeout_seconds, 1024)
            if ready[0] != "ready":
                raise _Overrun(f"a template worker started with {ready[0]!r}")
        except (TimeoutError, asyncio.IncompleteReadError, _Overrun) as exc:
            self._discard(worker)
            log.error("template worker did not start: %r", exc)
            message = "a template worker could not be started"
            raise BlockError("template_error", message, retryable=True) from exc
        except BaseException:
            self._discard(worker)
            raise
        return worker

    async def _died(self, worker: _Worker) -> BlockError:
        """The error for a worker that ended mid-request (our limits, or the OS's)."""
        try:
            async with asyncio.timeout(5):
                code: int | None = await worker.process.wait()
        except TimeoutError:
            code = None
        if code in (-signal.SIGXCPU, -signal.SIGPROF):
            message = f"the template took too long to evaluate (over {self.timeout_ms} ms)"
        elif code == -signal.SIGKILL:
            message = "the template needed more memory than it may use"
        else:
            log.warning("template worker %d ended with %s", worker.process.pid, code)
            message = "the template's worker process ended while evaluating it"
        return BlockError("template_error", message, retryable=False)

    def _discard(self, worker: _Worker) -> None:
        """Kill a worker (it may be mid-template) and reap it in the background."""
        if worker not in self._workers:
            return
        self._workers.discard(worker)
        worker.kill()
        if worker.process.stdin is not None:
            worker.process.stdin.close()
        task = asyncio.get_running_loop().create_task(worker.process.wait())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)


class _Sizes:
    """The encoded size of each answer, worked out once however often it is used."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._known: dict[int, tuple[Any, int]] = {}

    async def of(self, value: Any) -> int:
        if isinstance(value, str):
            return len(value)  # characters: a bound that costs nothing to check
        if value is None or isinstance(value, bool | int | float):
            return 8
        known = self._known.get(id(value))
        if known is None or known[0] is not value:
            try:
                # Only whether it passes the bound counts: sized as far as the bound, so
                # an echo of a 10 MB input costs what 1 MB does (step 16, row 1).
                size = await size_past(value, self._limit)
            except (TypeError, orjson.JSONEncodeError):
                size = self._encoded_size(value)
            known = self._known[id(value)] = (value, size)
        return known[1]

    @staticmethod
    def _encoded_size(value: Any) -> int:
        """Non-string keys, or nested too deep for orjson."""
        try:
            return len(orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS))
        except (TypeError, orjson.JSONEncodeError):  # nested too deep for orjson
            return len(str(value))


def _too_large(max_output_bytes: int) -> BlockError:
    message = f"template output exceeds {max_output_bytes} bytes"
    return BlockError("template_error", message, retryable=False)


def _substitute(value: Any, answers: dict[str, Any]) -> Any:
    if isinstance(value, str):
        return answers.get(value, value) if is_template(value) else value
    if isinstance(value, dict):
        return {key: _substitute(item, answers) for key, item in value.items()}
    if isinstance(value, list):
        return [_substitute(item, answers) for item in value]
    return value
