"""What a resume or a recovery needs, kept small in Redis (SPEC §7 "Redis footprint").

An execution's run state lives in its ``state`` hash: the workflow version and the
input, saved when it starts, and its checkpoint (checkpoint.py), saved with the events.
The workflow is stored once per version, under the sha256 of its JSON, not once per
execution; the input, when its JSON is larger than ``inline_bytes``, goes to the value
store, and so do large outputs and answers (as the checkpoint keeps them). So whatever
the size of the workflow, its input or its outputs, Redis holds a small constant per
block beside the events.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, cast

import orjson

from lib.backend import Batch, translated
from lib.errors import NotFound
from lib.execution.buffer import EventBuffer
from lib.execution.record import Field
from lib.execution.values import ValueStore, value_id
from lib.parsing import decode
from lib.slices import encode, sha256_hex
from lib.workflows.checkpoint import read_fields, write_fields
from lib.workflows.executor import RunState
from lib.workflows.model import Workflow

INLINE_BYTES = 8 * 1024
# The workflow versions one process keeps parsed, by the bytes they were read from.
VERSION_CACHE_BYTES = 16 * 1024 * 1024


class RunStates:
    """Saves and loads run states and workflow versions, on the buffer's Redis."""

    def __init__(
        self, *, buffer: EventBuffer, values: ValueStore, inline_bytes: int = INLINE_BYTES
    ) -> None:
        self._redis = buffer.redis
        self._keys = buffer.keys
        self._values = values
        self._inline_bytes = inline_bytes
        self._ttl = buffer.active_ttl_seconds
        # The versions read lately, newest last, with their stored size: bounded by
        # VERSION_CACHE_BYTES of what they were read from.
        self._versions: OrderedDict[str, tuple[Workflow, int]] = OrderedDict()
        self._version_bytes = 0

    @staticmethod
    def version(workflow: Workflow) -> str:
        """The digest ``save_version`` stores ``workflow`` under (worked out here)."""
        return workflow.canonical()[1]

    @translated
    async def save_version(self, workflow: Workflow) -> str:
        """Store a workflow definition once per version; returns its digest."""
        raw, digest = workflow.canonical()
        key = self._keys.workflow_version(digest)
        # Sent whole only when the store does not have it; else its TTL is refreshed,
        # so a version lives as long as the newest execution that runs it.
        if not await self._redis.expire(key, self._ttl):
            await self._redis.set(key, raw, ex=self._ttl)
        return digest

    def save_version_in(self, batch: Batch, workflow: Workflow) -> None:
        """``save_version`` with its first command in ``batch`` (the whole definition
        is sent after it, once the store said it lacks it)."""
        raw, digest = workflow.canonical()
        key = self._keys.workflow_version(digest)

        async def sent(kept: Any) -> None:
            if not kept:
                await self._redis.set(key, raw, ex=self._ttl)

        batch.call("EXPIRE", key, self._ttl, then=translated(sent))

    @translated
    async def load_version(
        self, digest: str, *, tenant: str = "", workflow_id: str = ""
    ) -> Workflow:
        """The workflow version ``digest`` names. Versions are content-addressed (the
        digest of their canonical JSON) and never change, so one read and validated
        here serves every later run of it in this process (``_versions``). A version
        the store lost (on a cluster, a node restarted empty) is found again in the
        tenant's stored workflow ``workflow_id`` when that still has the same digest,
        and saved again; NotFound otherwise."""
        cached = self._versions.get(digest)
        if cached is not None:
            self._versions.move_to_end(digest)
            return cached[0]
        raw = await self._redis.get(self._keys.workflow_version(digest))
        if raw is None:
            raw = await self._stored_as(digest, tenant, workflow_id)
        workflow = Workflow.model_validate(orjson.loads(raw))
        self._versions[digest] = (workflow, len(raw))
        self._version_bytes += len(raw)
        while self._version_bytes > VERSION_CACHE_BYTES and len(self._versions) > 1:
            _digest, (_workflow, size) = self._versions.popitem(last=False)
            self._version_bytes -= size
        return workflow

    async def _stored_as(self, digest: str, tenant: str, workflow_id: str) -> bytes:
        """The canonical JSON of ``digest`` from the tenant's stored workflow, saved as
        that version again; NotFound when the workflow is gone or changed since."""
        if tenant and workflow_id:
            stored = await self._redis.hget(self._keys.workflows(tenant), workflow_id)
            if stored is not None:
                raw, found = Workflow.model_validate(orjson.loads(stored)).canonical()
                if found == digest:
                    await self._redis.set(self._keys.workflow_version(digest), raw, ex=self._ttl)
                    return raw
        raise NotFound("workflow version", digest)

    async def save(
        self, execution_id: str, fields: dict[str, Any], *, deadline_ms: int | None = None
    ) -> dict[str, bytes]:
        """Persist fields of the run state; large ones as refs into the value store.
        Returns the fields as stored (to write back if the store loses them)."""
        encoded = {name: await self._encode(execution_id, value) for name, value in fields.items()}
        await self._save_fields(execution_id, encoded, deadline_ms=deadline_ms)
        return {name: orjson.dumps(value) for name, value in encoded.items()}

    async def encode(self, execution_id: str, fields: dict[str, Any]) -> dict[str, bytes]:
        """Fields of the run state as they are stored (large ones as refs)."""
        encoded = {name: await self._encode(execution_id, value) for name, value in fields.items()}
        return {name: orjson.dumps(value) for name, value in encoded.items()}

    async def save_checkpoint(self, execution_id: str, state: RunState) -> None:
        """Store a whole checkpoint again (into a store that lost it)."""
        fields = write_fields(state.outputs, state.skipped, state.attempts, state.answers)
        await self._save_fields(
            execution_id, {name: orjson.loads(value) for name, value in fields.items()}
        )

    async def load(
        self, execution_id: str, raw: dict[bytes, bytes] | None = None
    ) -> tuple[str, Any, RunState, dict[str, bytes]]:
        """(workflow version, input, checkpoint, the version and input fields as stored)
        as saved; NotFound when the store has none. ``raw``: the state hash as the
        caller read it already (``EventBuffer.meta_and_state``), not read again."""
        stored = await self._load_fields(execution_id) if raw is None else _fields(raw)
        if "workflow" not in stored:
            # Missing, or restored only in part (a store back from an older snapshot).
            raise NotFound("run state", execution_id)
        version = await self._decode(execution_id, stored["workflow"])
        input = await self._decode(execution_id, stored["input"]) if "input" in stored else None
        outputs, skipped, attempts, answers = read_fields(stored)
        if "run" in stored:
            # Saved by a pause of an earlier version, as one field.
            legacy = RunState.from_json(await self._decode(execution_id, stored["run"]) or {})
            outputs = {**legacy.outputs, **outputs}
            skipped = [*legacy.skipped, *(s for s in skipped if s not in legacy.skipped)]
            answers = {**legacy.answers, **answers}
        base: dict[str, bytes] = {}
        for name in ("workflow", "input"):
            if name in stored:
                base[name] = orjson.dumps(stored[name])
        return version, input, RunState(outputs, skipped, answers, attempts), base

    @translated
    async def _save_fields(
        self, execution_id: str, fields: dict[str, Any], *, deadline_ms: int | None = None
    ) -> None:
        """Write fields (JSON values) into the state hash, with the pause deadline if any."""
        encoded = {name: orjson.dumps(value) for name, value in fields.items()}
        async with self._redis.pipeline(transaction=False) as pipe:
            if encoded:
                pipe.hset(self._keys.state(execution_id), mapping=encoded)  # type: ignore[arg-type]
            pipe.expire(self._keys.state(execution_id), self._ttl)
            if deadline_ms is not None:
                pipe.hset(self._keys.meta(execution_id), Field.PAUSE_DEADLINE, str(deadline_ms))
            await pipe.execute()

    @translated
    async def _load_fields(self, execution_id: str) -> dict[str, Any]:
        raw = cast(dict[bytes, bytes], await self._redis.hgetall(self._keys.state(execution_id)))
        return _fields(raw)

    async def _encode(self, execution_id: str, value: Any) -> dict[str, Any]:
        raw = await encode(value)  # in slices: a run's input may be 10 MB
        if len(raw) <= self._inline_bytes:
            return {"v": value}
        ident = value_id(await sha256_hex(raw))
        await self._values.put(execution_id, ident, raw)
        return {"ref": ident}

    async def _decode(self, execution_id: str, wrapped: dict[str, Any]) -> Any:
        if "ref" in wrapped:
            parts = [chunk async for chunk in self._values.read(execution_id, wrapped["ref"])]
            return await decode(b"".join(parts), orjson.loads, orjson.loads)  # in slices
        return wrapped.get("v")


def _fields(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """The run state hash's fields, decoded (JSON values)."""
    return {name.decode(): orjson.loads(value) for name, value in raw.items()}
