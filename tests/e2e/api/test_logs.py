"""Log lines: JSON for machines, one readable line for a person at a terminal."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import sys

import pytest

from app import logs


def _record(name: str, message: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_text_lines_show_time_level_logger_message_then_the_execution_first() -> None:
    record = _record("lib.workflows.runner", "block %s failed", "talk", step=2, executionId="ex_1")
    line = logs.TextFormatter().format(record)
    assert re.fullmatch(
        r"\d\d:\d\d:\d\d\.\d{3} WARNING lib\.workflows\.runner: block talk failed  "
        r"executionId=ex_1 step=2",
        line,
    ), line


def test_text_fields_with_spaces_are_quoted_and_others_are_json() -> None:
    record = _record("flowcast", "x", error="it broke", tasks=["janitor"], where="a=b")
    line = logs.TextFormatter().format(record)
    assert line.endswith('  error="it broke" tasks=["janitor"] where="a=b"'), line


def test_a_text_access_line_is_method_path_and_status_with_the_token_redacted() -> None:
    record = _record(
        "uvicorn.access",
        '%s - "%s %s HTTP/%s" %d',
        "127.0.0.1:5000", "GET", "/api/executions/ex_1/stream?token=abc.def", "1.1", 200,
    )  # fmt: skip
    line = logs.TextFormatter().format(record)
    assert line.endswith(" uvicorn.access: GET /api/executions/ex_1/stream?token=[redacted] 200")


def test_a_text_line_carries_its_traceback_redacted() -> None:
    try:
        raise RuntimeError("fetching /v?token=secret-ish failed")
    except RuntimeError:
        record = logging.LogRecord(
            "flowcast", logging.ERROR, __file__, 1, "boom", None, exc_info=sys.exc_info()
        )
    text = logs.TextFormatter().format(record)
    first, *rest = text.splitlines()
    assert first.endswith(" ERROR   flowcast: boom")
    assert rest[0] == "Traceback (most recent call last):"
    assert "token=[redacted]" in text and "secret-ish" not in text


@pytest.mark.parametrize(
    ("log_format", "on_terminal", "expected"),
    [
        ("auto", True, logs.TextFormatter),
        ("auto", False, logs.JsonFormatter),
        ("json", True, logs.JsonFormatter),
        ("text", False, logs.TextFormatter),
    ],
)
def test_auto_is_text_on_a_terminal_and_json_elsewhere(
    log_format: logs.LogFormat, on_terminal: bool, expected: type[logging.Formatter]
) -> None:
    if not on_terminal:
        assert type(logs.formatter(log_format, io.StringIO())) is expected
        return
    main, child = pty.openpty()
    with os.fdopen(child, "w") as terminal:
        assert type(logs.formatter(log_format, terminal)) is expected
    os.close(main)


def test_json_lines_stay_one_object_each() -> None:
    record = _record("flowcast", "loaded %d", 3, executionId="ex_1")
    entry = json.loads(logs.JsonFormatter().format(record))
    assert entry["message"] == "loaded 3" and entry["executionId"] == "ex_1"
    assert entry["level"] == "warning" and entry["logger"] == "flowcast"
