"""The indexes a list of executions reads, so that a list reads what it returns.

Every execution of a tenant is listed, scored by its creation ms, in
(``Keys.listing``):

    index                        lists                                  written
    ---------------------------  -------------------------------------  ----------------------
    the tenant's                 every execution                        at its creation
    by workflow                  the tenant's runs of one workflow      at its creation
    by bucket (and workflow)     ``open`` (running, paused): unfinished  at its creation
                                 ``completed``, ``failed``, ``cancelled`` before its final event

A list picks the one index that holds exactly what its filters ask for (``read_key``)
and reads it newest first; ``open`` holds at most the tenant's unfinished executions
(``FLOWCAST_MAX_EXECUTIONS_PER_TENANT``), so a ``running`` or ``paused`` list reads no
more than those.

The creation indexes are written in the batch that admits the start, before the
execution exists (ownership.start); a terminal bucket is written by ``EventBuffer.append``
before the batch that stores the final event (the status field it sets). So an
execution is listed in the bucket of its status before anyone can read that status,
whichever process wrote it and whenever that process died: there is no step after the
final event that a SIGKILL could skip and leave the run unlisted. The indexes are
other keys than the execution's (another slot on a cluster), so none of this is atomic
with the record: an entry is a hint, and the record is the truth.

Entries that went stale are dropped by whoever meets them (``stale``), never one that
may still become true:

- ``open``: the final event's append takes the run out (best effort, after it); a run
  whose record is terminal is dropped by the next read (a finished run never reopens).
- a terminal bucket whose run ended otherwise (a ``completed`` refused because a cancel
  won: it ends ``cancelled``) is dropped once the record is terminal; while the record
  is unfinished the entry stays (that final event may still be stored).
- an entry whose record expired (retention) is dropped, past the grace a start needs to
  create the record it listed first (``INDEX_GRACE_SECONDS``).

Reads meet the newest entries only, so the oldest, expired ones are also swept at
random: each list read and each final event checks ``SWEEP`` random entries of the
indexes it touches and drops those whose record is gone (only those listed before the
grace are looked up: no other could be dropped). An index then holds about
``SWEEP / (SWEEP - 1)`` times its live entries once it is used, instead of growing with
every execution ever run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from redis.exceptions import RedisError

from lib.backend import Keys
from lib.execution.events import TERMINAL_STATUSES
from lib.execution.record import Field

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

OPEN = "open"  # the bucket of every unfinished status
# Random entries a read or a final event checks for an expired record.
SWEEP = 4
# How long after an execution is listed a list read may find no metadata for it
# without taking it for expired; above any clock skew between the replicas that write
# the indexes and read them.
INDEX_GRACE_SECONDS = 600
# Index entries a list read takes at a time, at most.
PAGE = 200
# How long one process may take to list a tenant's older executions (``complete``)
# before another may try.
BACKFILL_SECONDS = 300


def bucket(status: str | None) -> str | None:
    """The bucket index that lists executions in ``status`` (None: no status filter)."""
    if status is None:
        return None
    return status if status in TERMINAL_STATUSES else OPEN


def read_key(keys: Keys, tenant: str, *, workflow_id: str | None, status: str | None) -> str:
    """The index a list with these filters reads."""
    return keys.listing(tenant, workflow_id=workflow_id, bucket=bucket(status))


def creation_keys(keys: Keys, tenant: str, workflow_id: str) -> list[str]:
    """The indexes an execution is listed in when it is created."""
    return [
        keys.index(tenant),
        keys.listing(tenant, workflow_id=workflow_id, bucket=None),
        keys.listing(tenant, workflow_id=None, bucket=OPEN),
        keys.listing(tenant, workflow_id=workflow_id, bucket=OPEN),
    ]


def bucket_keys(keys: Keys, tenant: str, workflow_id: str, status: str) -> list[str]:
    """The indexes that list an execution in ``status``: its bucket, alone and with its
    workflow."""
    name = bucket(status)
    return [
        keys.listing(tenant, workflow_id=None, bucket=name),
        keys.listing(tenant, workflow_id=workflow_id, bucket=name),
    ]


def stale(index_bucket: str | None, status: str) -> bool:
    """True when an entry of an index of ``index_bucket`` whose record has ``status``
    can never be true again (a finished run keeps its status)."""
    if index_bucket is None or status not in TERMINAL_STATUSES:
        return False
    return index_bucket != status


def created_ms(created_at: str) -> int:
    """The creation ms (an index's score) of a record's ``createdAt``."""
    moment = datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    # Whole ms, as the start scored it: the timestamp has exactly three decimals.
    return int(moment.timestamp()) * 1000 + moment.microsecond // 1000


@dataclass(frozen=True)
class Listed:
    """Where one execution is listed: its tenant, its workflow, its creation ms."""

    tenant: str
    workflow_id: str
    created_ms: int

    @classmethod
    def of(cls, identity: Mapping[str, str]) -> Listed:
        """From a record's identity fields (``Field``: tenant, workflowId, createdAt)."""
        return cls(
            identity[Field.TENANT],
            identity[Field.WORKFLOW_ID],
            created_ms(identity[Field.CREATED_AT]),
        )


@dataclass(frozen=True)
class Before:
    """Where a page of a list starts: below the creation ms ``ms``, or, with
    ``execution_id``, just after that execution (listed at ``ms``) in the list's order.

    Entries of one ms are ordered by id (Redis orders equal scores by member), so a
    cursor with the last id shown loses none of the executions created in the same ms
    as it, and names none twice."""

    ms: int
    execution_id: str | None = None

    def keeps(self, raw_id: bytes, score: float) -> bool:
        """True for an entry listed after the cursor."""
        if score != self.ms or self.execution_id is None:
            return score < self.ms
        return raw_id < self.execution_id.encode()

    def top(self) -> float | str:
        """The highest score a page below the cursor reads (``(`` is exclusive)."""
        return self.ms if self.execution_id is not None else f"({self.ms}"


async def newest_first(
    redis: Redis,
    index: str,
    scan_limit: int,
    *,
    first_page: int,
    before: Before | None = None,
) -> AsyncIterator[list[tuple[bytes, float]]]:
    """An index's entries, newest first, in pages, each id once, up to ``scan_limit``:
    ``first_page`` entries first (what a list of an exact index reads), then pages
    twice as large each time, up to ``PAGE``; with ``before``, only those listed after
    that cursor.

    Pages go by score (the creation ms), each below the last one read, not by offset:
    starts that list new executions at the top (or listings taken back) between two
    pages would shift an offset, and the list would name an execution twice (a live
    list's client then kept the older copy) or skip one. An id a page names again
    (listed anew at the same millisecond) is skipped.
    """
    seen: set[bytes] = set()
    top: float | str = "+inf" if before is None else before.top()
    at_top = 0  # entries of the last page with the score ``top``: the next page skips them
    scanned = 0
    size = min(PAGE, max(1, first_page))
    while scanned < scan_limit:
        entries = cast(
            list[tuple[bytes, float]],
            await redis.zrevrangebyscore(
                index, top, "-inf", start=at_top, num=size, withscores=True
            ),
        )
        if not entries:
            return
        size = min(PAGE, size * 2)
        scanned += len(entries)
        lowest = entries[-1][1]
        ties = sum(1 for _raw_id, score in entries if score == lowest)
        at_top = ties + (at_top if lowest == top else 0)
        top = lowest
        fresh = [
            (raw_id, score)
            for raw_id, score in entries
            if raw_id not in seen and (before is None or before.keeps(raw_id, score))
        ]
        seen.update(raw_id for raw_id, _score in fresh)
        yield fresh


async def sweep(
    redis: Redis,
    keys: Keys,
    index_keys: Sequence[str],
    *,
    unlist: Sequence[tuple[str, str]] = (),
) -> int:
    """Check ``SWEEP`` random entries of each index in ``index_keys`` and drop those
    whose record expired (listed before the grace): the oldest entries, which no read
    reaches, leave too. How many were dropped. ``unlist`` (index, id) pairs are taken
    out in the same round trip as the sample (a final event's ``open`` entries).

    An entry the sample shows listed within the grace is not looked up: it could not be
    dropped (its score is its creation ms, and an entry listed again takes the record's
    own or a newer one). Those listed before it are, with their score read again after
    their record, as a read does."""
    async with redis.pipeline(transaction=False) as pipe:
        for key, member in unlist:
            pipe.zrem(key, member)
        for key in index_keys:
            pipe.zrandmember(key, SWEEP, withscores=True)
        answers = await pipe.execute()
    listed_before = (time.time() - INDEX_GRACE_SECONDS) * 1000
    picked = [
        (key, raw_id)
        for key, sample in zip(index_keys, answers[len(unlist) :], strict=True)
        for raw_id, score in _scored(sample)
        if score < listed_before
    ]
    if not picked:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for key, raw_id in picked:
            pipe.exists(keys.meta(raw_id.decode()))
            pipe.zscore(key, raw_id)
        answers = await pipe.execute()
    there, scores = answers[::2], answers[1::2]
    gone = [
        (key, raw_id)
        for (key, raw_id), found, score in zip(picked, there, scores, strict=True)
        if not found and score is not None and score < listed_before
    ]
    if gone:
        async with redis.pipeline(transaction=False) as pipe:
            for key, raw_id in gone:
                pipe.zrem(key, raw_id)
            await pipe.execute()
    return len(gone)


def _scored(sample: list[Any] | None) -> list[tuple[bytes, float]]:
    """ZRANDMEMBER ... WITHSCORES's answer as (id, score) pairs: RESP2 gives a flat
    list, RESP3 pairs."""
    if not sample:
        return []
    if isinstance(sample[0], list):
        return [(raw_id, float(score)) for raw_id, score in sample]
    return [(sample[n], float(sample[n + 1])) for n in range(0, len(sample), 2)]


async def complete(redis: Redis, keys: Keys, tenant: str) -> bool:
    """True when the tenant's workflow and bucket indexes list all its executions.

    Executions stored before these indexes existed are only in the tenant's index: the
    first filtered list of a tenant lists them (``backfill``), once, and marks the
    tenant done. While another process does that, False: the caller reads the tenant's
    whole index instead, as lists did before (slow, never incomplete)."""
    marker = keys.indexed(tenant)
    if await redis.get(marker) == b"1":
        return True
    if not await redis.set(marker, b"building", nx=True, ex=BACKFILL_SECONDS):
        return False
    try:
        await backfill(redis, keys, tenant)
    except BaseException:
        # Cut off (Redis failed, the request was cancelled): the next list tries again
        # at once, instead of every list reading the whole index until the marker expires.
        try:
            await redis.delete(marker)
        except (RedisError, OSError) as exc:
            log.warning("could not release a tenant's backfill", extra={"error": str(exc)})
        raise
    await redis.set(marker, b"1")
    return True


async def backfill(redis: Redis, keys: Keys, tenant: str) -> int:
    """List every execution of the tenant's index in the indexes of its workflow and of
    its status's bucket (ZADD NX: what is listed stays), a page at a time; how many."""
    fields = (Field.WORKFLOW_ID.value, Field.STATUS.value)
    listed = 0
    async for entries in newest_first(redis, keys.index(tenant), 2**62, first_page=PAGE):
        async with redis.pipeline(transaction=False) as pipe:
            for raw_id, _score in entries:
                pipe.hmget(keys.meta(raw_id.decode()), list(fields))
            found: list[list[bytes | None]] = await pipe.execute()
        async with redis.pipeline(transaction=False) as pipe:
            for (raw_id, score), (workflow, status) in zip(entries, found, strict=True):
                if workflow is None or status is None:
                    continue  # expired: a read drops it
                workflow_id = workflow.decode()
                by_workflow = keys.listing(tenant, workflow_id=workflow_id, bucket=None)
                for key in (by_workflow, *bucket_keys(keys, tenant, workflow_id, status.decode())):
                    pipe.zadd(key, {raw_id: score}, nx=True)
                listed += 1
            await pipe.execute()
    return listed
