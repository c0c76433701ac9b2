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
indexes it touches and drops those whose record is gone. An index then holds about
``SWEEP / (SWEEP - 1)`` times its live entries once it is used, instead of growing with
every execution ever run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from lib.backend import Keys
from lib.execution.events import TERMINAL_STATUSES
from lib.execution.record import Field

OPEN = "open"  # the bucket of every unfinished status
# Random entries a read or a final event checks for an expired record.
SWEEP = 4


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
