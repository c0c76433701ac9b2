"""Structured logs: one JSON object per line, with the record's ``extra`` fields.

No secret reaches a log line: stream tokens in query strings are redacted wherever a
message carries a URL (uvicorn's access log does), keys never enter a record (tenants
are named by a hash of their key), and every tenant secret value this process has
revealed to a run is masked as ``***`` (``mask_with``), tracebacks included.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Callable
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
    # On the handler too: records propagated from other loggers skip the root's level.
    handler.setLevel(level.upper())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn configures its own plain-text handlers before the app exists: route its
    # records through the same JSON formatter instead. Its access log stays off when
    # uvicorn turned it off (``--no-access-log``: no handler, no propagation).
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        turned_off = name == "uvicorn.access" and not logger.handlers and not logger.propagate
        logger.handlers.clear()
        logger.propagate = not turned_off
    # httpx logs every outbound request's URL at INFO: block calls are already events,
    # and such a URL may carry a secret.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
