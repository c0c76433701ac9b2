"""``Idempotency-Key`` on execute, resume and cancel.

**Execute: the key names its execution before the execution exists.** The first request
writes the key's record (``SET NX``: the request's fingerprint and a new execution id),
then creates the execution under that id. The record and the execution live in different
hash slots on a cluster, so no one script writes both; instead they are written in that
order, and whatever dies between the two writes, a repeat on any replica finds the
record and either finds the execution or creates it itself, with the id the record
names and its own body (the same request: the fingerprints match). start.lua creates an
id only once, so of two requests creating it at the same moment one runs it and the
other answers its id. No repeat waits for another request, and none starts a second
execution. The record says the outcome (202) once the execution is known to exist; a
request that fails below 500 before creating anything stores its error there instead,
unless another request answered first (idempotency.lua). A refusal that changed nothing
and asks the client to come back (429: the tenant's cap) is kept with the execution id
it names, and a repeat tries that same id again instead of replaying the 429: a client
that follows ``Retry-After`` with its key gets its execution once there is room, and two
repeats at once still create it once. A request refused 429 while another with the key
creates the execution (whose admission filled the cap) answers that execution: it
looks for it for a moment before answering the 429. A record whose execution is
missing and older than the retention of a finished execution is not created again: that
execution may have run and expired since. Should the store lose writes while the
execution runs here (a restore from an older snapshot), the owner writes the record back
(``SET NX``, with what was left of its time to live) before it writes the execution
back, so a repeat that finds the execution finds the record naming it too.

**Resume and cancel** claim the key (``SET NX``) and run; their outcome (status and
body, errors below 500 included) is stored for ``FLOWCAST_IDEMPOTENCY_SECONDS``. A
repeat with the same key and the same request gets that outcome, also while the first is
still running (it waits for it). An outcome of 500 or more is not kept, so the client may
retry (an execute's record stays: its retry finds or creates the execution it names).

The same key with a different request is 422.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import orjson
from fastapi import Request
from redis.asyncio import Redis

from app.errors import ApiError, error_payload
from app.limits import turn_set_aside
from lib.backend import Keys, load_script, translating
from lib.errors import BufferUnavailable, FlowcastError
from lib.parsing import decode
from lib.slices import encode, sha256_hex
from lib.workflows.runner import Started, new_execution_id

log = logging.getLogger(__name__)

WAIT_SECONDS = 30.0
# A claim whose request never finished (its process died) frees the key after this.
PENDING_SECONDS = 60
MAX_KEY_LENGTH = 255
# Execute outcomes a repeat does not replay but tries again (see the module doc).
RETRIED_STATUSES = frozenset({429})
# How long a keyed execute refused 429 looks for its execution created by a concurrent
# request with the key (admitted first, creating it: start.lua follows its admission).
CREATED_MEANWHILE_SECONDS = 0.25


async def fingerprint(scope: str, body: bytes) -> bytes:
    """What makes two requests "the same": the scope and the body as canonical JSON, so
    a retry serialized differently (spacing, key order) still matches. A large body is
    parsed and encoded in slices (lib/parsing.py, lib/slices.py): a 10 MB one held the
    loop ~0.1 s."""
    try:
        value = await decode(body, orjson.loads, orjson.loads)
        canonical = await encode(value, orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        canonical = body
    return scope.encode() + b"\0" + canonical


@dataclass(frozen=True)
class Outcome:
    status: int
    body: dict[str, Any]


def accepted(started: Started) -> Outcome:
    """The outcome of an execute, resume or cancel that took effect."""
    body: dict[str, Any] = {"executionId": started.execution_id, "status": started.status}
    if started.ahead is not None:
        body["ahead"] = started.ahead
    return Outcome(202, body)


def _checked(key: str) -> str:
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise ApiError(
            400, "invalid_idempotency_key", "Idempotency-Key must be 1-255 printable characters"
        )
    return key


def _answered(digest: str, outcome: Outcome, execution_id: str | None = None) -> bytes:
    """A record that holds its outcome (and the execution id a retried one still names)."""
    record: dict[str, Any] = {"fingerprint": digest, "status": outcome.status}
    if execution_id is not None:
        record["executionId"] = execution_id
    record["body"] = outcome.body
    return orjson.dumps(record)


class WriteBack:
    """Writes an execute's key record back as it was written (naming its execution),
    for what is left of its time to live, unless the key holds a record (``SET NX``):
    the run's owner calls it when the store lost writes of the run."""

    def __init__(self, redis: Redis, redis_key: str, record: bytes, expires: float) -> None:
        self._redis = redis
        self._key = redis_key
        self.record = record  # as the key holds it: naming the execution
        self._expires = expires  # monotonic seconds

    async def __call__(self) -> None:
        left_ms = int((self._expires - time.monotonic()) * 1000)
        if left_ms <= 0:
            return  # expired by now anyway
        with translating("write an Idempotency-Key back"):
            await self._redis.set(self._key, self.record, nx=True, px=left_ms)


def _reused() -> ApiError:
    return ApiError(
        422, "idempotency_key_reused", "this Idempotency-Key was used with a different request"
    )


class Idempotency:
    """Remembers outcomes by (tenant, operation, key) in Redis.

    ``retention_seconds`` is how long a finished execution's keys stay: an execute's
    record older than that whose execution is missing is not created again.
    """

    def __init__(
        self, *, redis: Redis, prefix: str, ttl_seconds: int, retention_seconds: int | None = None
    ) -> None:
        self._redis = redis
        self._keys = Keys(prefix)
        self._ttl = ttl_seconds
        self._retention = retention_seconds if retention_seconds is not None else ttl_seconds
        self._answer = redis.register_script(load_script(__package__, "idempotency.lua"))

    def _record(self, tenant: str, operation: str, key: str) -> str:
        return self._keys.idempotency(tenant, operation, hashlib.sha256(key.encode()).hexdigest())

    async def execute(
        self,
        request: Request,
        *,
        tenant: str,
        scope: str,
        action: Callable[[str, WriteBack | None], Awaitable[Started]],
        found: Callable[[str], Awaitable[Started]],
    ) -> Outcome:
        """Start an execution once per the request's ``Idempotency-Key``: ``action``
        creates the execution with the id it is given (or finds it created already),
        and hands the ``WriteBack`` of the key's record (None without a key) to the
        run, which writes the record back should the store lose it. ``found`` says what
        an execution the key names, created by another request, answers: ``queued``
        with its place while it waits in line, else ``running``."""
        key = request.headers.get("idempotency-key")
        if key is None:
            return accepted(await action(new_execution_id(), None))
        redis_key = self._record(tenant, "execute", _checked(key))
        digest = await sha256_hex(await fingerprint(scope, await request.body()))
        claimed = await self._claim(redis_key, digest, request, found)
        if isinstance(claimed, Outcome):
            return claimed
        execution_id, write_back = claimed
        try:
            started = await action(execution_id, write_back)
        except FlowcastError as exc:
            return await self._refused(
                exc, redis_key, digest, write_back.record, execution_id, found
            )
        outcome = accepted(started)
        await self._remember(redis_key, digest, outcome, exists=True)
        return outcome

    async def _claim(
        self,
        redis_key: str,
        digest: str,
        request: Request,
        found: Callable[[str], Awaitable[Started]],
    ) -> Outcome | tuple[str, WriteBack]:
        """The key's record, claimed for a new execution id or found naming one (the id
        to start, and the record's write-back), or the outcome a repeat answers."""
        while True:
            execution_id = new_execution_id()
            pending = orjson.dumps({"fingerprint": digest, "executionId": execution_id})
            written = time.monotonic()
            with translating("check the Idempotency-Key"):
                claimed = await self._redis.set(redis_key, pending, nx=True, ex=self._ttl)
            if claimed:
                return execution_id, WriteBack(self._redis, redis_key, pending, written + self._ttl)
            with translating("check the Idempotency-Key"):
                raw = await self._redis.get(redis_key)
            if raw is None:
                continue  # expired between the two commands: claim it afresh
            stored = orjson.loads(raw)
            if stored["fingerprint"] != digest:
                raise _reused()
            if "status" in stored and not (
                stored["status"] in RETRIED_STATUSES and "executionId" in stored
            ):
                return Outcome(stored["status"], stored["body"])
            if "executionId" not in stored:
                # Claimed by a server of the previous version, which records no id.
                return await self._repeat(redis_key, digest, request)
            execution_id = stored["executionId"]
            asked = time.monotonic()
            left_ms = await self._left_ms(redis_key, execution_id)
            if left_ms is None:
                outcome = accepted(await found(execution_id))
                await self._remember(redis_key, digest, outcome, exists=True)
                return outcome
            record = WriteBack(self._redis, redis_key, cast(bytes, raw), asked + left_ms / 1000)
            return execution_id, record

    async def _refused(
        self,
        exc: FlowcastError,
        redis_key: str,
        digest: str,
        pending: bytes,
        execution_id: str,
        found: Callable[[str], Awaitable[Started]],
    ) -> Outcome:
        """What a keyed start refused with ``exc`` answers (or raises), and records."""
        status, body = error_payload(exc)
        if status >= 500:
            raise exc  # the record stays: a retry finds or creates the execution it names
        if status in RETRIED_STATUSES and await self._created_meanwhile(execution_id):
            # A concurrent request with the key was admitted first and creates the
            # execution, which is what filled the cap: its outcome is this one's.
            outcome = accepted(await found(execution_id))
            await self._remember(redis_key, digest, outcome, exists=True)
            return outcome
        retried = execution_id if status in RETRIED_STATUSES else None
        first = await self._answer_once(redis_key, pending, digest, Outcome(status, body), retried)
        if first is not None and first != Outcome(status, body):
            return first  # another request answered first (it created the execution)
        raise exc

    async def _created_meanwhile(self, execution_id: str) -> bool:
        """Whether the execution a refused (429) keyed start names was created by a
        concurrent request with the key: its admission comes before its creation, so
        this looks again for a moment (``CREATED_MEANWHILE_SECONDS``), only on a 429."""
        loop = asyncio.get_running_loop()
        until = loop.time() + CREATED_MEANWHILE_SECONDS
        while True:
            with translating("check the Idempotency-Key"):
                if await self._redis.exists(self._keys.meta(execution_id)):
                    return True
            if loop.time() >= until:
                return False
            await asyncio.sleep(CREATED_MEANWHILE_SECONDS / 20)

    async def _left_ms(self, redis_key: str, execution_id: str) -> int | None:
        """None when the execution a record names exists, or may have existed (a record
        older than a finished execution's retention is never created again); else
        what is left of the record's time to live, in milliseconds."""
        with translating("check the Idempotency-Key"):
            if await self._redis.exists(self._keys.meta(execution_id)):
                return None
            left_ms = int(await self._redis.pttl(redis_key))
        # The record's age on Redis's clock: its time to live is set once, when written.
        if left_ms >= 0 and self._ttl * 1000 - left_ms >= self._retention * 1000:
            return None
        return max(left_ms, 0)

    async def _answer_once(
        self,
        redis_key: str,
        pending: bytes,
        digest: str,
        outcome: Outcome,
        execution_id: str | None = None,
    ) -> Outcome | None:
        """Store ``outcome`` in place of the pending record unless another request
        answered first; the outcome the record holds afterwards (None: it expired)."""
        value = _answered(digest, outcome, execution_id)
        try:
            with translating("remember an Idempotency-Key"):
                raw = await self._answer(keys=[redis_key], args=[pending, value, self._ttl])
        except BufferUnavailable as exc:
            # The pending record stays: a repeat finds or creates its execution.
            log.warning("could not remember an Idempotency-Key", extra={"error": str(exc)})
            return None
        if raw is None:
            return None
        stored = orjson.loads(raw)
        if "status" not in stored:
            return None
        return Outcome(stored["status"], stored["body"])

    async def run(
        self,
        *,
        tenant: str,
        operation: str,
        key: str | None,
        fingerprint: bytes,
        action: Callable[[], Awaitable[Outcome]],
        request: Request | None = None,
    ) -> Outcome:
        """Run ``action`` once per key; repeats get the first outcome (waiting for it
        without a turn of ``request``'s, app/limits.py ``turn_set_aside``)."""
        if key is None:
            return await action()
        redis_key = self._record(tenant, operation, _checked(key))
        digest = await sha256_hex(fingerprint)
        pending = orjson.dumps({"fingerprint": digest})
        with translating("check the Idempotency-Key"):
            claimed = await self._redis.set(
                redis_key, pending, nx=True, ex=min(self._ttl, PENDING_SECONDS)
            )
        if not claimed:
            return await self._repeat(redis_key, digest, request)
        try:
            outcome = await action()
        except FlowcastError as exc:
            status, body = error_payload(exc)
            if status >= 500:
                await self._forget(redis_key)
                raise
            await self._remember(redis_key, digest, Outcome(status, body))
            raise
        except BaseException:
            await self._forget(redis_key)
            raise
        await self._remember(redis_key, digest, outcome)
        return outcome

    async def accept(
        self,
        request: Request,
        *,
        tenant: str,
        operation: str,
        scope: str,
        action: Callable[[], Awaitable[Started]],
    ) -> Outcome:
        """Run an action that starts, resumes or cancels an execution, once per the
        request's ``Idempotency-Key``; its outcome is 202 with the execution's id."""

        async def took_effect() -> Outcome:
            return accepted(await action())

        key = request.headers.get("idempotency-key")
        return await self.run(
            tenant=tenant,
            operation=operation,
            key=key,
            # Only a keyed request is compared with its repeats.
            fingerprint=await fingerprint(scope, await request.body()) if key is not None else b"",
            action=took_effect,
            request=request,
        )

    async def _repeat(self, redis_key: str, digest: str, request: Request | None) -> Outcome:
        """The outcome of the first request with the key, once it has one: a repeat
        waits for it (up to ``WAIT_SECONDS``, then 409) holding no turn, since its first
        request may be on a process that died and never gives one."""
        if request is None:
            return await self._outcome_of_first(redis_key, digest)
        async with turn_set_aside(request.scope):
            return await self._outcome_of_first(redis_key, digest)

    async def _outcome_of_first(self, redis_key: str, digest: str) -> Outcome:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_SECONDS
        while True:
            with translating("check the Idempotency-Key"):
                raw = await self._redis.get(redis_key)
            if raw is None:
                raise ApiError(
                    409, "idempotency_retry", "the first request with this key failed; retry"
                )
            stored = orjson.loads(raw)
            if stored["fingerprint"] != digest:
                raise _reused()
            if "status" in stored:
                return Outcome(stored["status"], stored["body"])
            if loop.time() > deadline:
                raise ApiError(
                    409,
                    "idempotency_in_progress",
                    "the first request with this key is still running",
                )
            # The first request is still running: wait for its outcome.
            await asyncio.sleep(0.02)

    async def _remember(
        self, redis_key: str, digest: str, outcome: Outcome, *, exists: bool = False
    ) -> None:
        """Store the outcome; ``exists``: an execute's, whose record names an execution
        that exists now, so the record may only be answered (never made anew) and must
        stay if that fails."""
        value = _answered(digest, outcome)
        try:
            with translating("remember an Idempotency-Key"):
                await self._redis.set(redis_key, value, ex=self._ttl, xx=exists)
        except BufferUnavailable as exc:
            if exists:
                log.warning("could not remember an Idempotency-Key", extra={"error": str(exc)})
                return
            await self._forget(redis_key)

    async def _forget(self, redis_key: str) -> None:
        try:
            with translating("clear an Idempotency-Key"):
                await self._redis.delete(redis_key)
        except BufferUnavailable as exc:
            # The key expires on its own; until then a repeat waits, then may retry.
            log.warning("could not clear an Idempotency-Key", extra={"error": str(exc)})
