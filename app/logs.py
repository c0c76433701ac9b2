"""Structured logs: one JSON object per line, with the record's ``extra`` fields.

No secret reaches a log line: stream tokens in query strings are redacted wherever a
message carries a URL (uvicorn's access log does), and keys never enter a record
(tenants are named by a hash of their key).
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime
from typing import Any

import orjson

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


_TOKEN = re.compile(r"([?&]token=)[^&\s\"]*")


def redact(text: str) -> str:
    """``text`` with the value of every ``token=`` query parameter replaced."""
    return _TOKEN.sub(r"\1[redacted]", text)


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return orjson.dumps(entry, default=str).decode()


def configure(level: str) -> None:
    """Send every log record to stderr as JSON."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn configures its own plain-text handlers before the app exists: route its
    # records (access log included) through the same JSON formatter instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
