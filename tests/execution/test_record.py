"""The execution record is defined once: every script refusal is mapped, every field named.

These read the Lua sources under ``lib/`` and the Python modules, so a refusal added to
a script without its typed exception, a field written that ``Field`` does not name, or
a drawn table that no longer matches the code fails here (issue 23, point 1).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

import lib
from lib.errors import BufferUnavailable, FlowcastError
from lib.execution import ownership, record
from lib.execution import stream as reader
from lib.execution.events import (
    EXECUTION_COMPLETED,
    EXECUTION_PAUSED,
    EXECUTION_RECOVERED,
    EXECUTION_RESUMED,
    STATUS_AFTER,
    TERMINAL_STATUSES,
    TERMINAL_TYPES,
    Event,
)
from lib.execution.flush import batch_meta
from lib.execution.ownership import TRANSITIONS, draw_transitions
from lib.execution.record import (
    REFUSALS,
    TERMINAL,
    Asked,
    ExecutionMeta,
    Field,
    Reply,
    Script,
    Status,
    draw_refusals,
    refusal_of,
    refused,
)
from lib.workflows.launcher import identity_of

LIB = Path(lib.__file__).parent
# The prelude is no script of its own: backend.register puts it in front of each one
# (so its refusals, if it ever had any, are read as part of every script below).
PRELUDE = "prelude.lua"
SCRIPTS = sorted(path for path in LIB.rglob("*.lua") if path.name != PRELUDE)

# A refusal a script replies with: an error reply, or a table with an `err` field.
ERROR_REPLY = re.compile(r"redis\.error_reply\(\s*(?P<arg>[^)]*)\)")
ERR_TABLE = re.compile(r"\{\s*err\s*=\s*(?P<arg>[^}]*)\}")
# The first word of the reply, from the string literal it starts with.
FIRST_WORD = re.compile(r"""^["']([A-Z_]+)[ "']""")


def script_refusals(path: Path) -> set[str]:
    """The first word of every refusal ``path`` replies with; fails on one it cannot
    read (a reply built from a variable would escape this test)."""
    words = set()
    source = (LIB / "execution" / PRELUDE).read_text() + path.read_text()
    for pattern in (ERROR_REPLY, ERR_TABLE):
        for match in pattern.finditer(source):
            arg = match.group("arg").strip()
            word = FIRST_WORD.match(arg)
            assert word is not None, f"{path.name}: cannot read the refusal {arg!r}"
            words.add(word.group(1))
    return words


def test_the_lua_sources_are_found() -> None:
    names = {path.name for path in SCRIPTS}
    assert {"append.lua", "claim.lua", "renew.lua", "start.lua", "slots.lua"} <= names
    assert names <= {script.value for script in Script}, "a script the record does not name"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: path.name)
def test_every_refusal_a_script_replies_with_is_mapped(path: Path) -> None:
    mapped = {r.reply.value for r in REFUSALS if r.script == path.name}
    replied = script_refusals(path)
    assert replied - mapped == set(), f"{path.name} refuses with unmapped replies"
    assert mapped - replied == set(), f"REFUSALS names replies {path.name} never gives"


def test_every_refusal_builds_its_exception_with_its_fields() -> None:
    asked = Asked("ex_1", block_id="asked")
    for refusal in REFUSALS:
        detail = "7" if refusal.reply in (Reply.ORDER, Reply.HELD) else "detail"
        reply = f"{refusal.reply} {detail}" if refusal.detail else str(refusal.reply)
        error = refused(refusal.script, ResponseError(reply), asked)
        assert type(error) is refusal.error, refusal
        assert isinstance(error, FlowcastError)
        execution_id = getattr(error, "execution_id", None) or getattr(error, "ident", None)
        assert execution_id == "ex_1", refusal


def test_the_same_reply_of_two_scripts_means_what_each_script_says() -> None:
    asked = Asked("ex_1")
    fenced_writer = refused(Script.APPEND, ResponseError("FENCED other:1"), asked)
    fenced_renewal = refused(Script.RENEW, ResponseError("FENCED"), asked)
    assert type(fenced_writer).__name__ == "WriteFenced" and fenced_writer.owner == "other:1"  # type: ignore[attr-defined]
    assert type(fenced_renewal).__name__ == "Fenced"


def test_an_error_of_the_store_itself_is_an_outage_not_a_refusal() -> None:
    oom = ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    for script in Script:
        assert refusal_of(script, oom) is None
        assert isinstance(refused(script, oom, Asked("ex_1")), BufferUnavailable)
    # A reply of one script is not a refusal of another.
    assert refusal_of(Script.RENEW, ResponseError("NOTDUE")) is None


def test_no_module_decodes_a_script_reply_by_its_text() -> None:
    decoding = re.compile(r"str\(exc\)\.(startswith|partition|split)|ResponseError\(")
    offenders = [
        str(path.relative_to(LIB))
        for path in LIB.rglob("*.py")
        if path.name != "record.py" and decoding.search(path.read_text())
    ]
    assert offenders == []


def test_the_drawn_refusals_are_the_map() -> None:
    assert record.__doc__ is not None
    assert draw_refusals() in record.__doc__


def test_the_drawn_state_table_is_the_transition_table() -> None:
    assert ownership.__doc__ is not None
    assert draw_transitions() in ownership.__doc__


def test_every_refusal_of_a_transition_is_one_its_script_gives() -> None:
    for row in TRANSITIONS:
        for reply in row.refusals:
            assert any(r.script is row.script and r.reply is reply for r in REFUSALS), row


# Field names a script reads or writes on the metadata hash (a variable named `meta`).
META_CALL = re.compile(r"""redis\.call\(\s*"(?:HSET|HMGET|HDEL|HGET)",\s*meta,(?P<args>[^)]*)\)""")
START_FIELDS = re.compile(r"local fields = \{(?P<args>[^}]*)\}")
QUOTED = re.compile(r'"([A-Za-z]+)"')


def test_every_field_a_script_names_on_the_record_is_a_field() -> None:
    named: set[str] = set()
    for path in SCRIPTS:
        source = path.read_text()
        for match in META_CALL.finditer(source):
            named |= set(QUOTED.findall(match.group("args")))
        if path.name == "start.lua":
            fields = START_FIELDS.search(source)
            assert fields is not None
            named |= set(QUOTED.findall(fields.group("args")))
    values = {field.value for field in Field}
    # Status values written next to their field are not field names.
    assert named - values - {status.value for status in Status} == set()
    assert {"owner", "epoch", "status", "lastId", "reserved", "handoff"} <= named


def test_the_statuses_are_spec_section_3s() -> None:
    assert [status.value for status in Status] == [
        "queued", "running", "paused", "completed", "failed", "cancelled",
    ]  # fmt: skip
    assert TERMINAL == TERMINAL_STATUSES
    assert set(STATUS_AFTER.values()) <= set(Status)


def test_every_field_python_writes_on_the_record_is_a_field() -> None:
    def event(kind: str, data: dict[str, object]) -> Event:
        return Event(id=2, type=kind, execution_id="ex_1", workflow_id="wf", data=data)

    batch = [
        event(EXECUTION_PAUSED, {"blockId": "ask"}),
        event(EXECUTION_RESUMED, {"blockId": "ask", "input": {"approved": False}}),
        event(EXECUTION_RECOVERED, {"recovery": 1}),
        *(event(kind, {}) for kind in TERMINAL_TYPES),
    ]
    written = set(batch_meta(batch)) | set(identity_of(ExecutionMeta.from_hash("ex_1", {})))
    assert written - {field.value for field in Field} == set()
    assert {"status", "pauseBlock", "recoveries", "tenant", "crashes", "decision"} <= written


def test_a_batch_that_ends_the_run_dates_it_by_its_terminal_event() -> None:
    """``createdAt`` to ``updatedAt`` is the run's one duration (SPEC §9); a rejection is
    a decision the lists show, an approval is not."""
    ts = "2026-12-02T17:00:07.600Z"
    ending = Event(
        id=9, type=EXECUTION_COMPLETED, execution_id="ex_1", workflow_id="wf", data={}, ts=ts
    )
    assert batch_meta([ending])["updatedAt"] == ts

    def answer(given: object) -> Event:
        data = {"blockId": "ask", "input": given}
        return Event(id=5, type=EXECUTION_RESUMED, execution_id="ex_1", workflow_id="wf", data=data)

    assert batch_meta([answer({"approved": False, "note": "no"})])["decision"] == "rejected"
    for given in ({"approved": True}, {"approved": 0}, {}, [False], None):
        assert "decision" not in batch_meta([answer(given)]), given


def test_the_readme_shows_the_same_state_table() -> None:
    readme = (LIB.parent / "README.md").read_text()
    assert draw_transitions() in readme


def test_the_readme_shows_the_event_path_as_the_reader_draws_it() -> None:
    doc = reader.__doc__ or ""
    start = doc.index("    executor      emits it")
    end = doc.index("    app/sse.py    writes the frames")
    drawing = doc[start:end]
    assert drawing in (LIB.parent / "README.md").read_text()
