"""Live lists of a tenant's executions: the current list, then each status change.

An execution's status changes in two scripts: start.lua (it starts ``running``) and
append.lua (a batch that carries ``execution:paused``, ``resumed``, ``recovered`` or a
terminal event; batches of chunks never do). Each then publishes the execution's list
row on ``<prefix>:status``: ``{"id", "tenant", "workflowId", "status", "createdAt",
"updatedAt", "lastEventId"}``, with ``"errorCode"`` once failed (``quarantined``,
``worker_lost``, a block's code, …) and ``"decision": "rejected"`` once a person
answered an approval with ``approved: false``. One channel for every tenant: a handful of
messages per execution, against the ``notify`` message every stored batch already sends
to every process; and the readers' pub/sub connection (stream.py) subscribes to it
once, beside ``notify``, instead of subscribing and unsubscribing tenants on a
connection another task is reading.

That connection hands each message to this process's :class:`StatusFeed` (kept in the
registry, hub.py), which queues it for
the lists of that tenant open here (no Redis connection per list). A
:class:`ListReader` registers its queue first, then reads the list from the tenant's
index, so no change falls between the two; whenever the pub/sub connection was lost and
is back, every list is read again (a message sent meanwhile is lost, a status is not).
A change that arrives while the list is read may be older than what the read found: the
row's ``lastEventId`` (the execution's last stored id, which grows with every status
change) tells, and a change no newer than the row shown is not sent.

Frames (no ``id:`` line: a reconnecting client gets a fresh list, no replay):

- ``executions``: ``{"executions": [row, …]}``, newest first: the whole list, replace.
- ``execution``: ``row``: insert it or update it (rows are ordered by ``createdAt``,
  newest first, at most ``limit``).
- ``execution:unlisted``: ``{"id", "status"}``: the row no longer matches the status
  filter; drop it.

A reader keeps the rows its client shows (at most ``limit``), applying the same rules,
so it only sends what changes that view: a change to an execution older than every row
of a full list is not sent, nor one no newer than the row shown, and
``execution:unlisted`` only for a row shown. A full list that loses a row that way is
read (and sent) again: the next older match, which it left out, belongs in it now.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from lib.backoff import Backoff
from lib.errors import BufferUnavailable
from lib.execution.buffer import EventBuffer
from lib.execution.events import sse_frame
from lib.execution.record import ExecutionMeta

log = logging.getLogger(__name__)

LIST_EVENT = "executions"
ROW_EVENT = "execution"
UNLISTED_EVENT = "execution:unlisted"
# A list this far behind the changes is read again instead (it cannot keep up anyway).
MAX_QUEUED_CHANGES = 10_000
# List reads at once per process: after a pub/sub reconnect every list reads again.
# One tenant reads one list at a time, so its reads (a rare filter scans thousands of
# executions) never hold every slot while another tenant's lists wait.
LIST_READS = 4


@dataclass(frozen=True, slots=True)
class Row:
    """What a list shows of one execution."""

    id: str
    workflow_id: str
    status: str
    created_at: str
    updated_at: str
    last_id: int  # orders the changes of one execution
    error_code: str = ""  # why it failed ("quarantined", "worker_lost", …), once failed
    decision: str = ""  # "rejected": a person answered an approval with approved false

    @classmethod
    def of(cls, meta: ExecutionMeta) -> Row:
        error = meta.error if meta.status == "failed" and isinstance(meta.error, dict) else {}
        code = error.get("code")
        return cls(
            meta.id,
            meta.workflow_id,
            meta.status,
            meta.created_at,
            meta.updated_at,
            meta.last_id,
            code if isinstance(code, str) else "",
            meta.decision,
        )

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "workflowId": self.workflow_id,
            "status": self.status,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
            "lastEventId": self.last_id,
            **({"errorCode": self.error_code} if self.error_code else {}),
            **({"decision": self.decision} if self.decision else {}),
        }


def parse_change(data: bytes | str) -> tuple[str, Row] | None:
    """A ``<prefix>:status`` message as (tenant, row); None (logged) if malformed."""
    try:
        fields = orjson.loads(data)
        row = Row(
            str(fields["id"]),
            str(fields["workflowId"]),
            str(fields["status"]),
            str(fields["createdAt"]),
            str(fields["updatedAt"]),
            int(fields["lastEventId"]),
            str(fields.get("errorCode") or ""),
            str(fields.get("decision") or ""),
        )
        return str(fields["tenant"]), row
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        log.warning("a status message could not be read", extra={"error": str(exc)})
        return None


@dataclass(frozen=True)
class ListFilter:
    """Which executions a list shows, and how many."""

    limit: int = 20
    workflow_id: str | None = None
    status: str | None = None

    def keeps(self, meta: ExecutionMeta) -> bool:
        return self.matches(meta.workflow_id, meta.status)

    def matches(self, workflow_id: str, status: str) -> bool:
        return (self.workflow_id is None or workflow_id == self.workflow_id) and (
            self.status is None or status == self.status
        )


class Watch:
    """One list's queue of status changes; ``stale`` when the list must be read again."""

    __slots__ = ("_queue", "_wakeup", "closed", "stale", "tenant")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self._queue: deque[Row] = deque()
        self._wakeup = asyncio.Event()
        self.stale = True  # nothing read yet
        self.closed = False

    def push(self, row: Row) -> None:
        if self.stale:
            return  # the coming read shows it
        if len(self._queue) >= MAX_QUEUED_CHANGES:
            self.invalidate()
            return
        self._queue.append(row)
        self._wakeup.set()

    def invalidate(self) -> None:
        """Read the list again: some changes were lost."""
        # What is queued is older than that read, and sent after it would undo it.
        self.stale = True
        self._queue.clear()
        self._wakeup.set()

    def close(self) -> None:
        self.closed = True
        self._wakeup.set()

    def reading(self) -> None:
        """The list is about to be read: changes from now on follow it."""
        self.stale = False
        self._queue.clear()

    async def wait(self) -> list[Row]:
        """The changes queued (waiting for one), or none once stale or closed."""
        while not self._queue and not self.stale and not self.closed:
            self._wakeup.clear()
            await self._wakeup.wait()
        changes = list(self._queue)
        self._queue.clear()
        return changes

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the list is closed meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while not self.closed:
                    self._wakeup.clear()
                    await self._wakeup.wait()


class StatusFeed:
    """This process's live lists by tenant, fed by the readers' pub/sub connection."""

    def __init__(self, *, list_reads: int = LIST_READS) -> None:
        self._watches: dict[str, set[Watch]] = {}
        self._list_reads = asyncio.Semaphore(list_reads)
        self._tenant_reads: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def reading(self, tenant: str) -> AsyncIterator[None]:
        """A slot for one list read: one per tenant at a time, ``list_reads`` in all."""
        lock, users = self._tenant_reads.get(tenant, (asyncio.Lock(), 0))
        self._tenant_reads[tenant] = (lock, users + 1)
        try:
            async with lock, self._list_reads:
                yield
        finally:
            lock, users = self._tenant_reads[tenant]
            if users == 1:
                del self._tenant_reads[tenant]
            else:
                self._tenant_reads[tenant] = (lock, users - 1)

    def __len__(self) -> int:
        return sum(len(watches) for watches in self._watches.values())

    def watch(self, tenant: str) -> Watch:
        watch = Watch(tenant)
        self._watches.setdefault(tenant, set()).add(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        watches = self._watches.get(watch.tenant)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[watch.tenant]

    def publish(self, data: bytes | str) -> None:
        """One ``<prefix>:status`` message, to the lists of its tenant here."""
        if not self._watches:
            return  # no list open in this process: not even parsed
        change = parse_change(data)
        if change is None:
            return
        tenant, row = change
        for watch in self._watches.get(tenant, ()):
            watch.push(row)

    def invalidate_all(self) -> None:
        """The pub/sub connection was (re)established: every list reads again."""
        for watches in self._watches.values():
            for watch in watches:
                watch.invalidate()


class ListReader:
    """One client's live list: the rows, then the changes to them, as SSE frames.

    ``stream_token`` (when given) issues a token for each row's execution, sent as the
    row's ``streamToken`` so a browser can open that execution's stream.
    """

    def __init__(
        self,
        *,
        buffer: EventBuffer,
        feed: StatusFeed,
        tenant: str,
        wanted: ListFilter,
        stream_token: Callable[[str], str] | None = None,
        retry_base_seconds: float = 0.2,
        retry_max_seconds: float = 5.0,
    ) -> None:
        self._buffer = buffer
        self._feed = feed
        self._tenant = tenant
        self._wanted = wanted
        self._stream_token = stream_token
        self._backoff = Backoff(base=retry_base_seconds, cap=retry_max_seconds)
        self._watch: Watch | None = None
        self._first: list[Row] | None = None
        # The client's view: (createdAt, id) in ascending order, and its rows by id.
        self._order: list[tuple[str, str]] = []
        self._shown: dict[str, Row] = {}
        self.finished = False  # a list never finishes; it is closed
        self.closed = False

    async def open(self) -> None:
        """Register for changes, then read the list (BufferUnavailable if Redis is down).

        A reader opened and never iterated must be let go with :meth:`detach`."""
        watch = self._watch = self._feed.watch(self._tenant)
        try:
            watch.reading()
            self._first = await self._read()
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        if self._watch is not None:
            self._feed.unwatch(self._watch)
            self._watch = None

    def close(self) -> None:
        """End the stream at the next frame boundary."""
        self.closed = True
        if self._watch is not None:
            self._watch.close()

    async def frames(self) -> AsyncGenerator[bytes]:
        """SSE frames until closed (the client left, the server stops, the connection's
        time cap in ``app/sse.py``)."""
        try:
            async for chunk in self._frames():
                yield chunk
        finally:
            self.detach()

    async def _frames(self) -> AsyncIterator[bytes]:
        watch = self._watch
        if watch is None:
            watch = self._watch = self._feed.watch(self._tenant)
        first, self._first = self._first, None
        if first is not None:
            yield self._list_frame(first)
        while not self.closed:
            if watch.stale:
                watch.reading()
                try:
                    rows = await self._read()
                except BufferUnavailable as exc:
                    # The stream stays open and reads again once the buffer answers:
                    # ended, EventSource would reconnect into a 503 and give up.
                    log.warning("live list read failed; retrying", extra={"error": str(exc)})
                    await watch.sleep(self._backoff.next())
                    watch.invalidate()
                    continue
                self._backoff.reset()
                yield self._list_frame(rows)
                continue
            chunk = self._changes(await watch.wait())
            if chunk:
                yield chunk

    async def _read(self) -> list[Row]:
        async with self._feed.reading(self._tenant):
            wanted = self._wanted
            metas = await self._buffer.recent_metas(
                self._tenant,
                limit=wanted.limit,
                workflow_id=wanted.workflow_id,
                status=wanted.status,
            )
        return [Row.of(meta) for meta in metas]

    def _row(self, row: Row) -> dict[str, Any]:
        view: dict[str, Any] = row.view()
        if self._stream_token is not None:
            view["streamToken"] = self._stream_token(row.id)
        return view

    def _list_frame(self, rows: list[Row]) -> bytes:
        self._order = sorted((row.created_at, row.id) for row in rows)
        self._shown = {row.id: row for row in rows}
        body = orjson.dumps({"executions": [self._row(row) for row in rows]})
        return sse_frame(None, LIST_EVENT, body)

    def _changes(self, rows: Iterable[Row]) -> bytes:
        parts: list[bytes] = []
        for row in rows:
            if self._wanted.workflow_id not in (None, row.workflow_id):
                continue
            shown = self._shown.get(row.id)
            if shown is not None and row.last_id <= shown.last_id:
                continue  # what the client shows is as new or newer
            if self._wanted.status in (None, row.status):
                if self._show(row):
                    parts.append(sse_frame(None, ROW_EVENT, orjson.dumps(self._row(row))))
            elif self._hide(row.id):
                body = orjson.dumps({"id": row.id, "status": row.status})
                parts.append(sse_frame(None, UNLISTED_EVENT, body))
        return b"".join(parts)

    def _hide(self, execution_id: str) -> bool:
        shown = self._shown.pop(execution_id, None)
        if shown is None:
            return False
        full = len(self._order) >= self._wanted.limit
        self._order.remove((shown.created_at, execution_id))
        if full and self._watch is not None:
            # A full list had left out older matches: the next of them now belongs in
            # it, and only a read knows which (a reload would show it).
            self._watch.invalidate()
        return True

    def _show(self, row: Row) -> bool:
        """Put ``row`` in the view as the client will; False if it falls outside it."""
        if row.id in self._shown:
            self._shown[row.id] = row
            return True
        key = (row.created_at, row.id)
        if len(self._order) >= self._wanted.limit:
            if key < self._order[0]:
                return False  # older than every row of a full list
            _created, oldest = self._order.pop(0)
            del self._shown[oldest]
        bisect.insort(self._order, key)
        self._shown[row.id] = row
        return True
