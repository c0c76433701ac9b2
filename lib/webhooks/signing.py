"""Each tenant's webhook signing secret, and the Standard Webhooks signature.

The secret (``whsec_`` + base64 of 24 random bytes) is made on first use and stored in
Redis encrypted with AES-256-GCM under a key derived from ``FLOWCAST_SECRET_KEY`` (as
secrets.py does, with its own HKDF label and the tenant as associated data). A rotation
keeps the previous secret for ``ROTATION_SECONDS``: until then every delivery carries
two ``v1,`` signatures, the new secret's first, so receivers can switch at their pace.
A second rotation within that day cuts no earlier secret's day short (each keeps its
own end, up to ``MAX_OLDER`` of them), and rotations racing each other each keep the
secret they answered (the record is swapped only if unchanged since read).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import cast

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from redis.asyncio import Redis

from lib.backend import register, translated
from lib.errors import BufferUnavailable

PREFIX = "whsec_"
ROTATION_SECONDS = 24 * 3600
# At most this many secrets before the previous one still sign (rotated within a day).
MAX_OLDER = 8


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of "id.timestamp.body">`` with a ``whsec_`` secret."""
    key = base64.b64decode(secret.removeprefix(PREFIX))
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


@dataclass(frozen=True)
class TenantSecrets:
    """The secret that signs now, and the previous one while it still signs too."""

    current: str
    previous: str | None = None
    previous_until: float | None = None  # epoch seconds
    # Secrets before the previous one, rotated out within their day: (secret, until).
    older: tuple[tuple[str, float], ...] = ()

    def signing(self, now: float | None = None) -> list[str]:
        """The secrets to sign with now, the current one first, then the latest."""
        moment = time.time() if now is None else now
        return [self.current] + [secret for secret, until in self._before() if moment < until]

    def _before(self) -> list[tuple[str, float]]:
        """The earlier secrets with their ends, the latest first."""
        latest = [(self.previous, self.previous_until)] if self.previous else []
        return [(s, u) for s, u in latest if u] + list(self.older)


class WebhookSecrets:
    """Read, make and rotate tenants' webhook secrets, encrypted at rest."""

    def __init__(self, *, redis: Redis, key: bytes, prefix: str = "fc") -> None:
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"flowcast webhook secrets v1"
        ).derive(key)
        self._aead = AESGCM(derived)
        self._redis = redis
        self._key = f"{prefix}:{{webhooks}}:secrets"
        self._swap = register(redis, __package__, "outbox.lua")

    @translated
    async def get(self, tenant: str) -> TenantSecrets:
        """The tenant's secrets, made (once, whoever asks first) when it has none."""
        raw = cast(bytes | None, await self._redis.hget(self._key, tenant))
        if raw is None:
            await self._redis.hsetnx(self._key, tenant, self._seal(tenant, new_secret(), None))
            raw = cast(bytes, await self._redis.hget(self._key, tenant))
        return self._open(tenant, raw)

    @translated
    async def rotate(self, tenant: str) -> TenantSecrets:
        """A new current secret; the old one goes on signing for ``ROTATION_SECONDS``
        (and those before it until their own ends)."""
        await self.get(tenant)
        while True:
            raw = cast(bytes, await self._redis.hget(self._key, tenant))
            old = self._open(tenant, raw)
            now = time.time()
            older = [(s, u) for s, u in old._before() if now < u][:MAX_OLDER]
            sealed = self._seal(tenant, new_secret(), (old.current, now + ROTATION_SECONDS), older)
            swapped = await self._swap(keys=[self._key], args=["swap", tenant, raw, sealed])
            if swapped:
                return self._open(tenant, sealed)

    def _seal(
        self,
        tenant: str,
        current: str,
        previous: tuple[str, float] | None,
        older: list[tuple[str, float]] | None = None,
    ) -> bytes:
        plain = orjson.dumps(
            {"current": current, "previous": previous[0] if previous else None,
             "until": previous[1] if previous else None, "older": older or []}
        )  # fmt: skip
        nonce = secrets.token_bytes(12)
        sealed = self._aead.encrypt(nonce, plain, tenant.encode())
        return base64.b64encode(nonce + sealed)

    def _open(self, tenant: str, raw: bytes) -> TenantSecrets:
        try:
            blob = base64.b64decode(raw)
            plain = self._aead.decrypt(blob[:12], blob[12:], tenant.encode())
        except (InvalidTag, ValueError) as exc:
            raise BufferUnavailable(
                "the webhook secret cannot be decrypted: was FLOWCAST_SECRET_KEY changed?"
            ) from exc
        record = orjson.loads(plain)
        older = tuple((secret, until) for secret, until in record.get("older") or [])
        return TenantSecrets(record["current"], record.get("previous"), record.get("until"), older)
