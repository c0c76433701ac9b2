"""Logs on stderr, one record a line: JSON for machines, text for a person.

``FLOWCAST_LOG_FORMAT`` picks the format: ``json`` (one object per line with the
record's ``extra`` fields, ``executionId`` among them), ``text`` (time, level, logger,
message, then the fields as ``key=value``; an access line is just method, path and
status), or ``auto`` (the default): text when stderr is a terminal, JSON otherwise.

No secret reaches a log line: stream tokens in query strings are redacted wherever a
message carries a URL (uvicorn's access log does), keys never enter a record (tenants
are named by a hash of their key), and every tenant secret value this process has
revealed to a run is masked as ``***`` (``mask_with``), tracebacks included.
"""

from __future__ import annotations

import logging
import re
import sys
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

import orjson

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


# A query parameter as it appears in a URL; its name is decoded before it is judged, so
# every spelling the server would accept as ``token`` (``%74oken``, ``to%6Ben``) is caught.
_PARAMETER = re.compile(r"([?&])([^=&\s\"#]*)=([^&\s\"#]*)")
_SECRET_NAMES = frozenset({"token"})


def _redacted(match: re.Match[str]) -> str:
    name = urllib.parse.unquote_plus(match.group(2)).strip().lower()
    if name in _SECRET_NAMES:
        return f"{match.group(1)}{match.group(2)}=[redacted]"
    return match.group(0)


_masks: list[Callable[[str], str]] = []


def mask_with(mask: Callable[[str], str] | None) -> None:
    """Apply ``mask`` (e.g. ``SecretStore.redact_text``) to every line; None removes it."""
    _masks[:] = [mask] if mask is not None else []


def redact(text: str) -> str:
    """``text`` with the value of every ``token`` query parameter replaced, however its
    name is spelled, and every revealed secret masked."""
    # Tokens first: a secret that happens to look like "token" or "=" must not hide the
    # parameter's name from its own redaction.
    text = _PARAMETER.sub(_redacted, text) if "=" in text else text
    for mask in _masks:
        text = mask(text)
    return text


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for key, value in _fields(record).items():
            entry[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return orjson.dumps(entry, default=str).decode()


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD and not key.startswith("_")
    }


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        return value if value and not re.search(r"[\s\"=]", value) else orjson.dumps(value).decode()
    return orjson.dumps(value, default=str).decode()


class TextFormatter(logging.Formatter):
    """Formats a record as one readable line (a traceback follows on its own lines)."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        message = record.getMessage()
        access = record.args if record.name == "uvicorn.access" else None
        if isinstance(access, tuple) and len(access) == 5:
            # (client, method, path, HTTP version, status): who asked is in the JSON log.
            _, method, path, _, status = access
            message = f"{method} {path} {status}"
        fields = _fields(record)
        # The execution first: it is what a person follows from line to line.
        ordered = sorted(fields.items(), key=lambda item: item[0] != "executionId")
        # uvicorn.error is uvicorn's general logger, not an error.
        name = "uvicorn" if record.name == "uvicorn.error" else record.name
        line = f"{when} {record.levelname:<7} {name}: {message}"
        if ordered:
            line += "  " + " ".join(f"{key}={_text_value(value)}" for key, value in ordered)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


LogFormat = Literal["auto", "json", "text"]


def formatter(log_format: LogFormat, stream: TextIO) -> logging.Formatter:
    """The formatter for ``log_format``; ``auto`` is text on a terminal, else JSON."""
    if log_format == "auto":
        log_format = "text" if stream.isatty() else "json"
    return TextFormatter() if log_format == "text" else JsonFormatter()


def configure(level: str, log_format: LogFormat = "auto", stream: TextIO | None = None) -> None:
    """Send every log record to ``stream`` (stderr) in ``log_format``."""
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(log_format, stream))
    # On the handler too: records propagated from other loggers skip the root's level.
    handler.setLevel(level.upper())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn configures its own plain-text handlers before the app exists: route its
    # records through the same formatter instead. Its access log stays off when
    # uvicorn turned it off (``--no-access-log``: no handler, no propagation).
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        turned_off = name == "uvicorn.access" and not logger.handlers and not logger.propagate
        logger.handlers.clear()
        logger.propagate = not turned_off
    # httpx logs every outbound request's URL at INFO: block calls are already events,
    # and such a URL may carry a secret.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
