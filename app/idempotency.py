"""``Idempotency-Key`` on execute, resume and cancel.

The first request with a key claims it (``SET NX``) and runs; its outcome (status and
body, errors below 500 included) is stored for ``FLOWCAST_IDEMPOTENCY_SECONDS``. A
repeat with the same key and the same request gets that outcome, also while the first
is still running (it waits for it); the same key with a different request is 422. An
outcome of 500 or more is not kept, so the client may retry.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from redis.asyncio import Redis

from app.errors import ApiError, error_payload
from lib.backend import Keys, translating
from lib.errors import BufferUnavailable, FlowcastError
from lib.workflows.runner import Started

log = logging.getLogger(__name__)

WAIT_SECONDS = 30.0
# A claim whose request never finished (its process died) frees the key after this.
PENDING_SECONDS = 60
MAX_KEY_LENGTH = 255


def fingerprint(scope: str, body: bytes) -> bytes:
    """What makes two requests "the same": the scope and the body as canonical JSON, so
    a retry serialized differently (spacing, key order) still matches."""
    try:
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        canonical = body
    return scope.encode() + b"\0" + canonical


@dataclass(frozen=True)
class Outcome:
    status: int
    body: dict[str, Any]


class Idempotency:
    """Remembers outcomes by (tenant, operation, key) in Redis."""

    def __init__(self, *, redis: Redis, prefix: str, ttl_seconds: int) -> None:
        self._redis = redis
        self._keys = Keys(prefix)
        self._ttl = ttl_seconds

    async def run(
        self,
        *,
        tenant: str,
        operation: str,
        key: str | None,
        fingerprint: bytes,
        action: Callable[[], Awaitable[Outcome]],
    ) -> Outcome:
        """Run ``action`` once per key; repeats get the first outcome."""
        if key is None:
            return await action()
        if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
            raise ApiError(
                400, "invalid_idempotency_key", "Idempotency-Key must be 1-255 printable characters"
            )
        digest = hashlib.sha256(fingerprint).hexdigest()
        name = hashlib.sha256(key.encode()).hexdigest()
        redis_key = self._keys.idempotency(tenant, operation, name)
        pending = orjson.dumps({"fingerprint": digest})
        with translating("check the Idempotency-Key"):
            claimed = await self._redis.set(
                redis_key, pending, nx=True, ex=min(self._ttl, PENDING_SECONDS)
            )
        if not claimed:
            return await self._repeat(redis_key, digest)
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

        async def accepted() -> Outcome:
            started = await action()
            return Outcome(202, {"executionId": started.execution_id, "status": started.status})

        key = request.headers.get("idempotency-key")
        return await self.run(
            tenant=tenant,
            operation=operation,
            key=key,
            # Only a keyed request is compared with its repeats.
            fingerprint=fingerprint(scope, await request.body()) if key is not None else b"",
            action=accepted,
        )

    async def _repeat(self, redis_key: str, digest: str) -> Outcome:
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
                raise ApiError(
                    422,
                    "idempotency_key_reused",
                    "this Idempotency-Key was used with a different request",
                )
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

    async def _remember(self, redis_key: str, digest: str, outcome: Outcome) -> None:
        value = orjson.dumps(
            {"fingerprint": digest, "status": outcome.status, "body": outcome.body}
        )
        try:
            with translating("remember an Idempotency-Key"):
                await self._redis.set(redis_key, value, ex=self._ttl)
        except BufferUnavailable:
            await self._forget(redis_key)

    async def _forget(self, redis_key: str) -> None:
        try:
            with translating("clear an Idempotency-Key"):
                await self._redis.delete(redis_key)
        except BufferUnavailable as exc:
            # The key expires on its own; until then a repeat waits, then may retry.
            log.warning("could not clear an Idempotency-Key", extra={"error": str(exc)})
