"""The shell examples of a Markdown file, run the way a reader would run them.

The README and ``docs/*.md`` follow these conventions so that every example can run:

- A block fenced as ```` ```sh ```` is run; one fenced as ```` ```sh notest ```` is only
  shown. ``notest`` is for what a test cannot do: start a server of its own, build or
  run containers, call ``make``, reach a model on the network, run for minutes.
- A command is one line, or several joined by a trailing backslash, or a line with a
  heredoc (``<<'EOF'``) and its body. Commands run with bash, one after another in
  document order, in the repository's root.
- ``http://127.0.0.1:8000`` (or ``localhost:8000``) is the test's server, and
  ``FLOWCAST_URL`` points the CLI at it; ``.venv/bin/flowcast`` is the ``flowcast`` next
  to the Python running the tests.
- ``ex_…`` and ``lv_…`` stand for the execution id and the value id that an earlier
  command of the same file printed last.
- A command must exit 0, unless its comment says ``(exit N)``.
- ``# → text``, after a command on its own line or on the lines right after it, is
  what the command prints: its output (stdout and stderr) must contain that text, with
  ``…`` standing for anything.
- A command that prints an error body (``{"error":{…}}``) fails the test, unless one of
  its ``→`` lines shows an error too.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOWCAST = Path(sys.executable).with_name("flowcast")

_FENCE = re.compile(r"^```(.*)$")
_HEREDOC = re.compile(r"<<-?\s*'?([A-Za-z_]+)'?")
_COMMENT = re.compile(r"\s#\s+(.*)$")
_EXIT = re.compile(r"\(exit (\d+)\)")
_SHOWN = re.compile(r"^#\s*→\s?(.*)$")
_SERVER = re.compile(r"(?:http://)?(?:127\.0\.0\.1|localhost):8000\b")
_IDS = {"ex_…": re.compile(r"ex_[A-Za-z0-9_-]{20,}"), "lv_…": re.compile(r"lv_[0-9a-f]{64}")}
_ERROR_BODY = '{"error":{'


@dataclass(frozen=True)
class Block:
    """One fenced ``sh`` block: where its first line is, its lines, whether it runs."""

    path: Path
    line: int
    lines: list[str]
    tested: bool


@dataclass
class Command:
    """One command of a block, with what its comments promise."""

    where: str
    text: str
    exit_code: int = 0
    shown: list[str] = field(default_factory=list)


def shell_blocks(path: Path) -> list[Block]:
    """Every ``sh`` block of a Markdown file, in order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while not lines[end].startswith("```"):
            end += 1
        info = opening.group(1).split()
        if info and info[0] == "sh":
            tested = "notest" not in info[1:]
            blocks.append(Block(path, index + 2, lines[index + 1 : end], tested))
        index = end + 1
    return blocks


def commands(block: Block) -> list[Command]:
    """The block's commands, each with its expected exit code and output."""
    found: list[Command] = []
    lines = block.lines
    index = 0
    while index < len(lines):
        stripped = lines[index].strip()
        if not stripped or stripped.startswith("#"):
            shown = _SHOWN.match(stripped)
            if shown and found:
                found[-1].shown.append(shown.group(1))
            index += 1
            continue
        start = index
        while lines[index].endswith("\\"):
            index += 1
        heredoc = _HEREDOC.search(lines[index])
        commented = lines[start : index + 1]
        if heredoc:
            while lines[index + 1] != heredoc.group(1):
                index += 1
            index += 1
        where = f"{block.path.name}:{block.line + start}"
        command = Command(where, "\n".join(lines[start : index + 1]))
        for line in commented:
            comment = _COMMENT.search(line)
            if comment is None:
                continue
            if code := _EXIT.search(comment.group(1)):
                command.exit_code = int(code.group(1))
            if shown := _SHOWN.match("# " + comment.group(1)):
                command.shown.append(shown.group(1))
        found.append(command)
        index += 1
    return found


@dataclass
class Session:
    """Runs a file's commands against one server, carrying ids from one to the next."""

    url: str
    timeout: float = 60.0
    ids: dict[str, str] = field(default_factory=dict)

    def prepared(self, command: Command) -> str:
        text = _SERVER.sub(self.url, command.text).replace(".venv/bin/flowcast", str(FLOWCAST))
        for placeholder in _IDS:
            if placeholder in text:
                assert placeholder in self.ids, f"{command.where}: no earlier {placeholder} id"
                text = text.replace(placeholder, self.ids[placeholder])
        return text

    def environment(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("FLOWCAST_")}
        return {**base, "FLOWCAST_URL": self.url, "PYTHONPATH": str(ROOT)}

    async def run(self, command: Command) -> None:
        """Run one command; AssertionError (with its output) if it broke a promise."""
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", self.prepared(command),
            cwd=ROOT, env=self.environment(), start_new_session=True,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with asyncio.timeout(self.timeout):
                raw_out, raw_err = await process.communicate()
        finally:
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)  # bash and what it started
                await process.wait()
        out, err = raw_out.decode(errors="replace"), raw_err.decode(errors="replace")
        shown = out + err
        report = f"{command.where}: {command.text}\n--- out\n{out[-3000:]}\n--- err\n{err[-3000:]}"
        assert process.returncode == command.exit_code, f"exit {process.returncode}\n{report}"
        for text in command.shown:
            pattern = ".*?".join(re.escape(part) for part in text.split("…"))
            assert re.search(pattern, shown, re.DOTALL), f"does not show {text!r}\n{report}"
        if _ERROR_BODY in out and not any('"error"' in text for text in command.shown):
            raise AssertionError(f"an error body\n{report}")
        for placeholder, pattern in _IDS.items():
            if found := pattern.findall(shown):
                self.ids[placeholder] = found[-1]


async def run_examples(path: Path, *, url: str) -> int:
    """Run every tested ``sh`` block of ``path`` against ``url``; how many commands ran."""
    session = Session(url)
    count = 0
    for block in shell_blocks(path):
        if block.tested:
            for command in commands(block):
                await session.run(command)
                count += 1
    return count
