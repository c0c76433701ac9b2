"""A template worker process: evaluates templates for ``TemplatePool`` under OS limits.

Started as ``python -m lib.workflows.worker --timeout-ms N --max-bytes N --memory-bytes N``.
It speaks on stdin and stdout; every message is a 4-byte big-endian length and a pickle:

    worker -> pool   ("ready", pid)                         once, when it can evaluate
    pool -> worker   (kind, [source, ...], context)          kind "render" or "condition"
    worker -> pool   ("ok", value)                           per source, in order, until
                     ("error", code, message)                the first error
                     ("done", recycle)                       after each request

While it evaluates a request the worker lowers its own soft limits: its address space
to what it uses with the request loaded plus ``memory_bytes`` (and some slack for the
interpreter), so an allocation past that is a MemoryError; its CPU time to what it has
used plus the timeout, so SIGXCPU ends it if the pool cannot. The pool measures time
itself and kills a worker that does not answer; these limits are the backstop. Values
come back as plain data (None, bool, int, float, str, list, dict) so the pool unpickles
them without any class.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import resource
import signal
import struct
import sys
from typing import Any

from lib.errors import BlockError
from lib.workflows.templates import Templates

HEADER = struct.Struct(">I")
MiB = 1024 * 1024
# Room for the interpreter itself while it evaluates (frames, small objects, the reply).
SLACK_BYTES = 32 * MiB
# The CPU timer fires this far past the bound: after the sandbox's own check, which
# gives the clearer error whenever the template reaches one.
CPU_TIMER_FACTOR = 1.2


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read(fd: int) -> Any:
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    body = _read_exactly(fd, HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _write(fd: int, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def address_space() -> int:
    """This process's virtual memory size in bytes (what RLIMIT_AS counts)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class _Limits:
    """Lowers the soft address-space and CPU limits around one request.

    The CPU bound is enforced three ways: the sandbox's own check (a clean error, on
    calls and item access), a CPU timer (``ITIMER_PROF``: its SIGPROF, left at its
    default action, ends the process a little past the bound, even in the middle of one
    long C-level operation such as a huge multiplication that never reaches a check),
    and ``RLIMIT_CPU`` (whole seconds) behind both.
    """

    def __init__(self, *, memory_bytes: int, timeout_seconds: float) -> None:
        self.memory_bytes = memory_bytes
        self.timeout_seconds = timeout_seconds
        self.hard_as = resource.getrlimit(resource.RLIMIT_AS)[1]
        self.hard_cpu = resource.getrlimit(resource.RLIMIT_CPU)[1]

    def __enter__(self) -> None:
        limit = address_space() + self.memory_bytes + SLACK_BYTES
        if self.hard_as != resource.RLIM_INFINITY:
            limit = min(limit, self.hard_as)
        resource.setrlimit(resource.RLIMIT_AS, (limit, self.hard_as))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(usage.ru_utime + usage.ru_stime + self.timeout_seconds) + 1
        if self.hard_cpu != resource.RLIM_INFINITY:
            cpu = min(cpu, self.hard_cpu)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, self.hard_cpu))
        signal.setitimer(signal.ITIMER_PROF, self.timeout_seconds * CPU_TIMER_FACTOR + 0.05)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0)
        resource.setrlimit(resource.RLIMIT_AS, (self.hard_as, self.hard_as))
        resource.setrlimit(resource.RLIMIT_CPU, (self.hard_cpu, self.hard_cpu))


def _evaluate(
    templates: Templates, kind: str, source: str, context: dict[str, Any], memory_bytes: int
) -> tuple[Any, ...]:
    """One source's reply, already pickled-size checked."""
    try:
        if kind == "condition":
            value: Any = templates.condition(source, context)
        else:
            value = templates.render(source, context)
        reply = ("ok", value)
        size = len(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        if size > templates.max_output_bytes + 1024:
            message = f"template output exceeds {templates.max_output_bytes} bytes"
            return ("error", "template_error", message)
        return reply
    except BlockError as exc:
        return ("error", exc.code, exc.message)
    except MemoryError:
        message = f"the template needed more than {memory_bytes // MiB} MiB of memory"
        return ("error", "template_error", message)
    except RecursionError:
        return ("error", "template_error", "the template nests too deeply")
    except Exception as exc:  # a sandbox gap or a bug: still this template's failure
        print(f"template worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ("error", "template_error", f"{type(exc).__name__}: {exc}")


def serve(*, timeout_ms: int, max_bytes: int, memory_bytes: int, out: int) -> None:
    """Answer requests from stdin until it closes."""
    timeout = timeout_ms / 1000
    templates = Templates(max_output_bytes=max_bytes, max_render_seconds=timeout)
    limits = _Limits(memory_bytes=memory_bytes, timeout_seconds=timeout)
    baseline = address_space()
    _write(out, ("ready", os.getpid()))
    while True:
        request = _read(0)
        if request is None:
            return
        kind, sources, context = request
        with limits:
            for source in sources:
                reply = _evaluate(templates, kind, source, context, memory_bytes)
                _write(out, reply)
                if reply[0] == "error":
                    break
        del request, context
        # Memory the interpreter kept after a large evaluation stays mapped: start afresh.
        _write(out, ("done", address_space() > baseline + 2 * (memory_bytes + SLACK_BYTES)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lib.workflows.worker")
    parser.add_argument("--timeout-ms", type=int, required=True)
    parser.add_argument("--max-bytes", type=int, required=True)
    parser.add_argument("--memory-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal is for the server; it closes our stdin when it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # the CPU timer ends the process
    # Keep the protocol's stdout to ourselves: anything printed goes to stderr.
    out = os.dup(1)
    os.dup2(2, 1)
    try:
        serve(
            timeout_ms=args.timeout_ms,
            max_bytes=args.max_bytes,
            memory_bytes=args.memory_bytes,
            out=out,
        )
    except BrokenPipeError:
        pass  # the pool went away mid-reply


if __name__ == "__main__":
    main(sys.argv[1:])
