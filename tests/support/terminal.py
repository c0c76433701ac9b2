"""A command run on a pseudo-terminal, as a person at a terminal runs it (the CLI tests)."""

from __future__ import annotations

import contextlib
import os
import pty
import signal
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def pty_process(
    args: list[str], env: dict[str, str], *, stdin: bool = False, stderr: bool = True
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Start ``args`` with a pseudo-terminal as its stdout (and its stdin, its stderr if
    asked); yields the process and the terminal's side to read (and type into). On
    leaving, a process still running is killed (Popen's exit would wait for it for
    good, and so would the test's thread and worker), and the terminal is closed."""
    main, child = pty.openpty()
    with subprocess.Popen(
        args,
        env=env,
        stdin=child if stdin else None,
        stdout=child,
        stderr=child if stderr else subprocess.DEVNULL,
        preexec_fn=_as_from_a_shell,
    ) as process:
        os.close(child)
        try:
            yield process, main
        finally:
            if process.poll() is None:
                process.kill()
            os.close(main)


def _as_from_a_shell() -> None:
    """In the command's process before it starts: Ctrl-C as a terminal's shell leaves it
    (default, not blocked). The test worker's may not be (in full-suite runs the CLI
    inherited a SIGINT it never saw: every Ctrl-C test there timed out at its prompt),
    and a program keeps a SIGINT it finds ignored, as Python does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
