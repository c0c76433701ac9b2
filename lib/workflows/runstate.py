"""What a resume needs, kept small in Redis (SPEC §7 "Redis footprint").

An execution's run state (its input, and once paused its outputs so far) lives in its
``state`` hash. The workflow it runs is stored once per version, under the sha256 of
its JSON, not once per execution; and any field whose JSON is larger than
``inline_bytes`` goes to the value store, leaving a small ref in Redis. So whatever the
size of the workflow, its input or its outputs, Redis holds a small constant per
execution beside its events.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from lib.backend import translated
from lib.errors import NotFound
from lib.execution.ownership import Ownership
from lib.execution.values import ValueStore, value_id
from lib.workflows.model import Workflow

INLINE_BYTES = 8 * 1024


class RunStates:
    """Saves and loads run states and workflow versions."""

    def __init__(
        self, *, ownership: Ownership, values: ValueStore, inline_bytes: int = INLINE_BYTES
    ) -> None:
        self._ownership = ownership
        self._redis = ownership.redis
        self._keys = ownership.keys
        self._values = values
        self._inline_bytes = inline_bytes
        self._ttl = ownership.buffer.active_ttl_seconds

    @translated
    async def save_version(self, workflow: Workflow) -> str:
        """Store a workflow definition once per version; returns its digest."""
        raw = orjson.dumps(workflow.to_json(), option=orjson.OPT_SORT_KEYS)
        digest = hashlib.sha256(raw).hexdigest()
        key = self._keys.workflow_version(digest)
        # Sent whole only when the store does not have it; else its TTL is refreshed,
        # so a version lives as long as the newest execution that runs it.
        if not await self._redis.expire(key, self._ttl):
            await self._redis.set(key, raw, ex=self._ttl)
        return digest

    @translated
    async def load_version(self, digest: str) -> Workflow:
        raw = await self._redis.get(self._keys.workflow_version(digest))
        if raw is None:
            raise NotFound("workflow version", digest)
        return Workflow.model_validate(orjson.loads(raw))

    async def save(
        self, execution_id: str, fields: dict[str, Any], *, deadline_ms: int | None = None
    ) -> None:
        """Persist fields of the run state; large ones as refs into the value store."""
        encoded = {name: await self._encode(execution_id, value) for name, value in fields.items()}
        await self._ownership.save_state(execution_id, encoded, deadline_ms=deadline_ms)

    async def load(self, execution_id: str) -> dict[str, Any]:
        """The run state as saved; NotFound when the store has none."""
        stored = await self._ownership.load_state(execution_id)
        if "workflow" not in stored:
            # Missing, or restored only in part (a store back from an older snapshot).
            raise NotFound("run state", execution_id)
        return {name: await self._decode(execution_id, value) for name, value in stored.items()}

    async def _encode(self, execution_id: str, value: Any) -> dict[str, Any]:
        raw = orjson.dumps(value)
        if len(raw) <= self._inline_bytes:
            return {"v": value}
        ident = value_id(hashlib.sha256(raw).hexdigest())
        await self._values.put(execution_id, ident, raw)
        return {"ref": ident}

    async def _decode(self, execution_id: str, wrapped: dict[str, Any]) -> Any:
        if "ref" in wrapped:
            parts = [chunk async for chunk in self._values.read(execution_id, wrapped["ref"])]
            return orjson.loads(b"".join(parts))
        return wrapped.get("v")
