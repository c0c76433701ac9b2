"""The event model: one envelope per event, encoded once and shared by every reader.

An event's JSON envelope and its SSE frame are computed at most once, so fan-out to
many clients and replay from Redis both send the same bytes without re-encoding.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any, Final

import orjson

from lib import slices

EXECUTION_STARTED: Final = "execution:started"
BLOCK_STARTED: Final = "block:started"
BLOCK_CHUNK: Final = "block:chunk"
BLOCK_COMPLETED: Final = "block:completed"
BLOCK_FAILED: Final = "block:failed"
BLOCK_SKIPPED: Final = "block:skipped"
EXECUTION_PAUSED: Final = "execution:paused"
EXECUTION_RESUMED: Final = "execution:resumed"
EXECUTION_RECOVERED: Final = "execution:recovered"
EXECUTION_COMPLETED: Final = "execution:completed"
EXECUTION_FAILED: Final = "execution:failed"
EXECUTION_CANCELLED: Final = "execution:cancelled"

EVENT_TYPES: Final = frozenset(
    {
        EXECUTION_STARTED,
        BLOCK_STARTED,
        BLOCK_CHUNK,
        BLOCK_COMPLETED,
        BLOCK_FAILED,
        BLOCK_SKIPPED,
        EXECUTION_PAUSED,
        EXECUTION_RESUMED,
        EXECUTION_RECOVERED,
        EXECUTION_COMPLETED,
        EXECUTION_FAILED,
        EXECUTION_CANCELLED,
    }
)

# The status an execution has once the event of this type is stored.
STATUS_AFTER: Final[dict[str, str]] = {
    EXECUTION_PAUSED: "paused",
    EXECUTION_RESUMED: "running",
    EXECUTION_RECOVERED: "running",
    EXECUTION_COMPLETED: "completed",
    EXECUTION_FAILED: "failed",
    EXECUTION_CANCELLED: "cancelled",
}
TERMINAL_TYPES: Final = frozenset({EXECUTION_COMPLETED, EXECUTION_FAILED, EXECUTION_CANCELLED})
TERMINAL_STATUSES: Final = frozenset({"completed", "failed", "cancelled"})
# A run's last event: shown live only once stored (see log.py).
FINAL_TYPES: Final = frozenset({EXECUTION_PAUSED, *TERMINAL_TYPES})

# Checkpoint fields an event carries to its run state: (field, JSON value) pairs.
Checkpoint = tuple[tuple[str, bytes], ...]

_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def carriable(value: Any) -> Any:
    """``value`` as JSON that any event can carry (SPEC §2 "Block outputs are JSON").

    Integers beyond the signed 64-bit range become their decimal string and lone
    surrogates become U+FFFD; anything else orjson cannot encode becomes its ``str``.
    The common case costs one encode and one scan of the bytes.
    """
    try:
        encoded = orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):
        return _carriable(value)
    if _LONG_DIGITS.search(encoded):
        return _carriable(value)
    return value


async def carried(value: Any) -> Any:
    """``carriable(value)``, encoded and scanned in slices (``lib.slices``): a block's
    35 MB output was encoded and scanned for long digits at once on the event loop
    (step 16, row 1)."""
    try:
        encoded = await slices.encode(value)
    except (orjson.JSONEncodeError, TypeError):
        return _carriable(value)
    if await slices.search(_LONG_DIGITS, encoded):
        return _carriable(value)
    return value


def _carriable(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _INT_MAX else str(value)
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_carriable_key(key): _carriable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_carriable(item) for item in value]
    return _carriable(str(value))


def _carriable_key(key: Any) -> str:
    return _carriable(key if isinstance(key, str) else str(key))  # type: ignore[no-any-return]


def utc_timestamp(moment: datetime | None = None) -> str:
    """An ISO 8601 UTC timestamp with milliseconds, as in the envelope's ``ts``."""
    if moment is not None:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    # Every event needs one: format the seconds once per second, not once per event.
    now = time.time()
    second = int(now)
    if _second_prefix[0] != second:
        stamp = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
        _second_prefix[:] = [second, stamp]
    return f"{_second_prefix[1]}{int((now - second) * 1000):03d}Z"


_second_prefix: list[Any] = [-1, ""]


class Event:
    """One event of one execution, with its envelope encoded lazily and only once."""

    __slots__ = (
        "_data",
        "_frame",
        "_json",
        "_ts",
        "checkpoint",
        "created",
        "execution_id",
        "id",
        "type",
        "workflow_id",
    )

    def __init__(
        self,
        *,
        id: int,
        type: str,
        execution_id: str,
        workflow_id: str,
        data: dict[str, Any],
        ts: str | None = None,
        checkpoint: Checkpoint = (),
    ) -> None:
        self.id = id
        self.type = type
        self.execution_id = execution_id
        self.workflow_id = workflow_id
        self._data: dict[str, Any] | None = data
        self._ts: str | None = ts or utc_timestamp()
        self._json: bytes | None = None
        self._frame: bytes | None = None
        # When it was emitted (monotonic), for the stream latency metric; 0 if read back.
        self.created = time.monotonic()
        # Run state fields stored with it, in the same write (SPEC §7 "Checkpoints").
        self.checkpoint = checkpoint

    @classmethod
    def stored(cls, *, id: int, type: str, raw: bytes) -> Event:
        """An event read back from the buffer; its envelope is decoded only if asked."""
        event = cls.__new__(cls)
        event.id = id
        event.type = type
        event._json = raw
        event._frame = None
        event._data = None
        event._ts = None
        event.created = 0.0
        event.checkpoint = ()
        return event

    def _decode(self) -> None:
        envelope = orjson.loads(self.json)
        self._data = envelope["data"]
        self.execution_id = envelope["executionId"]
        self.workflow_id = envelope["workflowId"]
        self._ts = envelope["ts"]

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            self._decode()
        assert self._data is not None
        return self._data

    @property
    def ts(self) -> str:
        """When it was emitted (UTC, as in its envelope)."""
        if self._ts is None:
            self._decode()
        assert self._ts is not None
        return self._ts

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_TYPES

    def envelope(self) -> dict[str, Any]:
        """The envelope as a dict (decoded from the stored bytes for a stored event)."""
        if self._data is None:
            envelope: dict[str, Any] = orjson.loads(self.json)
            return envelope
        return {
            "id": self.id,
            "type": self.type,
            "executionId": self.execution_id,
            "workflowId": self.workflow_id,
            "ts": self.ts,
            "data": self.data,
        }

    async def encode(self) -> None:
        """Encode the envelope now, in slices when it is large (``lib.slices``), so that
        ``json`` does not encode it whole on the event loop."""
        if self._json is None:
            self._json = await slices.encode(self.envelope())

    @property
    def json(self) -> bytes:
        """The envelope as compact JSON (never contains a newline)."""
        if self._json is None:
            self._json = orjson.dumps(self.envelope())
        return self._json

    @property
    def frame(self) -> bytes:
        """The event as one SSE frame: ``id:``, ``event:``, ``data:`` and a blank line."""
        if self._frame is None:
            self._frame = sse_frame(self.id, self.type, self.json)
        return self._frame


def sse_frame(event_id: int | None, event_type: str, data: bytes) -> bytes:
    """Encode one SSE frame; ``event_id`` None leaves out the ``id:`` line."""
    head = b"" if event_id is None else b"id: %d\n" % event_id
    return head + b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


PING_FRAME: Final = b": ping\n\n"
