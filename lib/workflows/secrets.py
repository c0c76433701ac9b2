"""Tenants' secrets: encrypted at rest, readable only by the runs of their own tenant.

A secret is stored in its tenant's Redis hash, encrypted with AES-256-GCM (the
``cryptography`` package) under a key derived by HKDF-SHA256 from the server's secret
key. The tenant and the name are the associated data, so a value copied to another
tenant's hash or under another name does not decrypt. No route ever returns a value:
only ``reveal`` does, for a run of the same tenant whose templates read it.

Wherever a value could come back out (a block's output, its streamed chunks, an error
message, a log line), ``redact.Redactor`` puts ``***`` in its place. A run masks every
secret its workflow reads from its start, the value before the last change too
(``masks``), so a value echoed back by a block that reads no secret, after a resume
or a recovery, or after the secret was changed, is masked all the same. The values
this process revealed last are also kept for ``redact_text``, which the log formatter
applies to every line: a line logged for a tenant (``CURRENT_TENANT``: set by the request's
authentication and by a run) is masked with that tenant's values only, so one tenant's
secrets never blank another's lines; a line of no tenant, with every tenant's.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import datetime
import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from redis.asyncio import Redis

from lib.backend import Keys, translating
from lib.errors import BlockError, BufferUnavailable, InvalidInput, NotFound, Problem
from lib.quota import StorageQuota, secret_member
from lib.tenancy import CURRENT_TENANT
from lib.workflows.redact import Redactor, spelled
from lib.workflows.templates import secret_names

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
log = logging.getLogger(__name__)

MAX_VALUE_BYTES = 8 * 1024
# Shorter values are refused: masking one would blank ordinary words in every line and
# output of its tenant ("api", "ex_"), and a guessable value is no secret anyway.
MIN_VALUE_CHARS = 8
MAX_SECRETS = 1000
MAX_SECRETS_PER_WORKFLOW = 64
# How many values a process masks in its log lines, in all: each tenant's most recently
# revealed, the tenant that holds the most giving up its oldest first, so no tenant's
# secrets push another's out (step 16's fresh-eyes review).
_REMEMBERED = 1_000


@dataclass(frozen=True)
class SecretInfo:
    name: str
    updated_at: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "updatedAt": self.updated_at}


def check_name(name: str) -> None:
    """InvalidInput unless ``name`` can be read as ``{{ secrets.NAME }}``."""
    if not NAME.match(name):
        raise InvalidInput(
            "invalid secret name",
            [Problem("name", "1-64 letters, digits or '_', not starting with a digit")],
        )


class SecretStore:
    """Put, list, delete and (for runs only) reveal one tenant's secrets."""

    def __init__(
        self, *, redis: Redis, key: bytes, prefix: str = "fc", quota: StorageQuota | None = None
    ) -> None:
        self._quota = quota
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"flowcast secrets v1"
        ).derive(key)
        self._aead = AESGCM(derived)
        self._redis = redis
        self._keys = Keys(prefix)
        self._revealed: dict[str, OrderedDict[str, None]] = {}  # per tenant, oldest first
        self._remembered = 0
        self._masks: dict[str, Redactor] = {}  # per tenant

    async def put(self, tenant: str, name: str, value: str) -> tuple[SecretInfo, bool]:
        """Store ``value`` as ``name``; the secret's listing, and whether it is new."""
        check_name(name)
        plain = value.encode("utf-8", "surrogatepass")
        if len(value) < MIN_VALUE_CHARS:
            problem = Problem("$.value", f"a secret is at least {MIN_VALUE_CHARS} characters")
            raise InvalidInput("secret too short", [problem])
        if len(plain) > MAX_VALUE_BYTES:
            raise InvalidInput(
                "secret too large",
                [Problem("$.value", f"a secret is at most {MAX_VALUE_BYTES} bytes")],
            )
        nonce = secrets.token_bytes(12)
        sealed = self._aead.encrypt(nonce, plain, _aad(tenant, name))
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
        info = SecretInfo(name, now.replace("+00:00", "Z"))
        record = {"at": info.updated_at, "sealed": base64.b64encode(nonce + sealed).decode()}
        key = self._keys.secrets(tenant)
        with translating("store the secret"):
            before = cast(bytes | None, await self._redis.hget(key, name))
            if before is None and await self._redis.hlen(key) >= MAX_SECRETS:
                raise InvalidInput(
                    "too many secrets",
                    [Problem("name", f"a tenant may keep at most {MAX_SECRETS} secrets")],
                )
            if before is not None:
                # The value it replaces stays masked: a run, or a remote side, may still
                # hold it and echo it back.
                record["previous"] = orjson.loads(before).get("sealed", "")
        return info, await self._counted(tenant, name, orjson.dumps(record))

    async def _counted(self, tenant: str, name: str, raw: bytes) -> bool:
        """Store a secret's record once its tenant's storage quota has room for it
        (``OverQuota`` before anything is written); whether it is new. A store that
        fails puts the secret's previous figure back."""
        key, member = self._keys.secrets(tenant), secret_member(name)
        previous = 0
        if self._quota is not None:
            previous = await self._quota.reserve(tenant, member, len(raw) + len(name))
        try:
            with translating("store the secret"):
                return bool(await self._redis.hset(key, name, raw))
        except BaseException:
            if self._quota is not None and previous:
                await self._quota.record(tenant, member, previous)
            elif self._quota is not None:
                await self._quota.forget(tenant, member)
            raise

    async def list(self, tenant: str) -> list[SecretInfo]:
        """Names and update times, never values."""
        with translating("list secrets"):
            stored = cast(dict[bytes, bytes], await self._redis.hgetall(self._keys.secrets(tenant)))
        found = [
            SecretInfo(name.decode(), str(orjson.loads(raw).get("at", "")))
            for name, raw in stored.items()
        ]
        return sorted(found, key=lambda info: info.name)

    async def delete(self, tenant: str, name: str) -> None:
        with translating("delete the secret"):
            removed = await self._redis.hdel(self._keys.secrets(tenant), name)
        if self._quota is not None:
            await self._quota.forget(tenant, secret_member(name))
        if not removed:
            raise NotFound("secret", name)

    async def reveal(self, tenant: str, names: set[str]) -> dict[str, str]:
        """The values of ``names`` for a run of ``tenant``; a BlockError for a missing one."""
        ordered = sorted(names)
        if not ordered:
            return {}
        with translating("read secrets"):
            stored = cast(
                list[bytes | None], await self._redis.hmget(self._keys.secrets(tenant), ordered)
            )
        values: dict[str, str] = {}
        for name, raw in zip(ordered, stored, strict=True):
            if raw is None:
                raise BlockError(
                    "secret_missing",
                    f"secret {name!r} is not set: PUT /api/secrets/{name} first",
                    retryable=False,
                )
            values[name] = self._open(tenant, name, orjson.loads(raw).get("sealed"))
        self._remember(tenant, await spelled(values.values()))
        return values

    async def masks(self, tenant: str, names: set[str]) -> Sequence[str]:
        """Every value a run of ``tenant`` reading ``names`` must mask: the ones set now
        and the ones they replaced (missing or unreadable secrets are skipped: the block
        that reads one fails, saying why)."""
        ordered = sorted(names)
        if not ordered:
            return []
        with translating("read secrets"):
            stored = cast(
                list[bytes | None], await self._redis.hmget(self._keys.secrets(tenant), ordered)
            )
        found: builtins.list[str] = []  # (``list`` here is the method above)
        for name, raw in zip(ordered, stored, strict=True):
            if raw is None:
                continue
            record = orjson.loads(raw)
            for sealed in (record.get("sealed"), record.get("previous")):
                if sealed:
                    with contextlib.suppress(BlockError):
                        found.append(self._open(tenant, name, sealed))
        self._remember(tenant, await spelled(found))
        return found

    def _open(self, tenant: str, name: str, sealed: Any) -> str:
        try:
            blob = base64.b64decode(sealed)
            plain = self._aead.decrypt(blob[:12], blob[12:], _aad(tenant, name))
        except (InvalidTag, KeyError, ValueError, TypeError) as exc:
            raise BlockError(
                "secret_unreadable",
                f"secret {name!r} cannot be decrypted: was FLOWCAST_SECRET_KEY changed?",
                retryable=False,
            ) from exc
        return plain.decode("utf-8", "surrogatepass")

    def _remember(self, tenant: str, values: Mapping[str, frozenset[str]]) -> None:
        revealed = self._revealed.setdefault(tenant, OrderedDict())
        for value in values:
            self._remembered += value not in revealed
            revealed[value] = None
            revealed.move_to_end(value)
        self._masks.setdefault(tenant, Redactor()).add_spelled(values)
        while self._remembered > _REMEMBERED:
            owner = max(self._revealed, key=lambda name: len(self._revealed[name]))
            forgotten, _ = self._revealed[owner].popitem(last=False)
            self._remembered -= 1
            mask = self._masks[owner]
            mask.remove([forgotten])
            if not self._revealed[owner]:
                del self._revealed[owner], self._masks[owner]

    def redact_text(self, text: str) -> str:
        """``text`` with the values this process revealed replaced by ``***``: those of
        the tenant ``CURRENT_TENANT`` names, or every tenant's when it names none."""
        tenant = CURRENT_TENANT.get()
        if tenant is not None:
            mask = self._masks.get(tenant)
            return mask.text(text) if mask is not None else text
        for mask in list(self._masks.values()):
            text = mask.text(text)
        return text


def _aad(tenant: str, name: str) -> bytes:
    return f"{tenant}\x00{name}".encode()


class RunSecrets:
    """One run's view of its tenant's secrets: which each block reads (worked out once
    per run, not per attempt), their values when a block runs, and the redactor that
    masks every one of them in what the run emits."""

    def __init__(
        self, *, store: SecretStore | None, tenant: str | None, configs: dict[str, Any]
    ) -> None:
        self._store = store
        self._tenant = tenant
        self._names = {block_id: secret_names(config) for block_id, config in configs.items()}
        self.redactor = Redactor()

    async def mask_from_the_start(self, execution_id: str) -> None:
        """Mask every secret the workflow reads (and the value each replaced) before any
        block runs: a block that reads none may echo one an earlier run read (before a
        pause, a recovery or a hand-off), or one a remote side kept."""
        names = set().union(*self._names.values())
        if not names or self._store is None or self._tenant is None:
            return
        try:
            # Spelled again rather than handed over: a cache hit each, and a value the
            # cache dropped meanwhile is worked out again a value at a time.
            self.redactor.add_spelled(await spelled(await self._store.masks(self._tenant, names)))
        except BufferUnavailable as exc:
            # The blocks that read secrets cannot run either until it is back.
            log.warning(
                "secrets to mask not read", extra={"executionId": execution_id, "error": str(exc)}
            )

    async def reveal(self, block_id: str) -> dict[str, str]:
        """The secrets ``block_id``'s templates read, revealed now (and masked from now on)."""
        names = self._names.get(block_id)
        if not names:
            return {}
        if self._store is None or self._tenant is None:
            raise BlockError("secret_missing", "secrets are not available here", retryable=False)
        try:
            values = await self._store.reveal(self._tenant, names)
        except BufferUnavailable as exc:
            raise BlockError("secret_unavailable", f"secrets could not be read: {exc}") from exc
        self.redactor.add_spelled(await spelled(values.values()))
        return values
