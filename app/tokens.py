"""Stream tokens: signed, scoped to one execution (or one tenant's list), expiring.

Browsers' EventSource cannot send headers, so the SSE and values routes also accept
``?token=``. A token is ``<expiry>.<hmac>`` where the HMAC covers the execution id and
the expiry, so it is useless for any other execution or after it expires.

The live list of executions takes a list token, ``<alias>.<expiry>.<hmac>``: the HMAC
covers ``list:<tenant>`` and the expiry. No execution id contains ``:``, so neither kind
of token ever passes for the other. The alias is an HMAC of the tenant under the same
secret: a token reveals nothing about the tenant's key (a tenant is named by a hash of
its key, and a weak key was found from that hash offline in step 16's review).

Nothing a token grants outlives it: the stream tokens a live list hands out expire with
its list token (``not_after``), and the list itself ends then.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# What ``issue`` writes: decimal ASCII seconds, a dot, an unpadded urlsafe-base64 SHA-256.
# Checking the shape first keeps ``check`` total: ``str.isdigit`` and ``int`` accept
# other digits (``²``, fullwidth ones) and ``compare_digest`` raises on non-ASCII text, so a
# hostile query string must never reach them as anything but a plain "no".
_TOKEN = re.compile(r"(?P<expires>[0-9]{1,15})\.(?P<mac>[A-Za-z0-9_-]{43})")
_LIST_TOKEN = re.compile(
    r"(?P<alias>[A-Za-z0-9_-]{22})\.(?P<expires>[0-9]{1,15})\.(?P<mac>[A-Za-z0-9_-]{43})"
)


@dataclass(frozen=True)
class ListGrant:
    """What the live list's caller may read: ``tenant``'s list, until ``expires`` (epoch
    seconds; None for an API key, which grants it for as long as it is configured)."""

    tenant: str
    expires: int | None


def load_secret(configured: str | None, data_dir: Path) -> bytes:
    """The configured secret, or one generated once and kept under the data directory."""
    if configured:
        return configured.encode()
    path = data_dir / "secret_key"
    if path.exists():
        return path.read_bytes().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(32).encode()
    path.touch(mode=0o600)
    path.write_bytes(secret)
    return secret


class StreamTokens:
    """Issues and checks stream tokens with one secret."""

    def __init__(self, *, secret: bytes, lifetime_seconds: int) -> None:
        self._secret = secret
        self._lifetime = lifetime_seconds

    def _mac(self, execution_id: str, expires: int) -> str:
        return self._digest(f"{execution_id}.{expires}")

    def _digest(self, message: str) -> str:
        digest = hmac.new(self._secret, message.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def _alias(self, tenant: str) -> str:
        return self._digest(f"alias:{tenant}")[:22]

    def issue(
        self, execution_id: str, *, now: float | None = None, not_after: int | None = None
    ) -> str:
        """A token for ``execution_id``'s stream and values, expiring after the lifetime
        or at ``not_after`` (the expiry of the token it was handed out under)."""
        expires = int((time.time() if now is None else now) + self._lifetime)
        if not_after is not None:
            expires = min(expires, not_after)
        return f"{expires}.{self._mac(execution_id, expires)}"

    def check(self, token: str, execution_id: str, *, now: float | None = None) -> bool:
        """True when the token was issued for this execution and has not expired.

        Any string that is not a well-formed token is simply not valid: never an error.
        """
        match = _TOKEN.fullmatch(token)
        if match is None or ":" in execution_id:
            # No execution id has a ":"; a list token's MAC covers "list:<tenant>", so
            # one with its tenant cut off would otherwise pass for that "execution".
            return False
        expires = int(match["expires"])
        if expires < (time.time() if now is None else now):
            return False
        expected = self._mac(execution_id, expires).encode()
        return hmac.compare_digest(match["mac"].encode(), expected)

    def issue_list(self, tenant: str, *, now: float | None = None) -> str:
        """A token for ``tenant``'s live list of executions."""
        expires = int((time.time() if now is None else now) + self._lifetime)
        return f"{self._alias(tenant)}.{expires}.{self._mac(_list_scope(tenant), expires)}"

    def list_grant(
        self, token: str, tenants: Iterable[str], *, now: float | None = None
    ) -> ListGrant | None:
        """Which of ``tenants`` (those with a configured key) ``token`` opens the list
        of, and until when; None if it is not a valid token for any of them."""
        match = _LIST_TOKEN.fullmatch(token)
        if match is None:
            return None
        expires = int(match["expires"])
        if expires < (time.time() if now is None else now):
            return None
        alias = match["alias"].encode()
        found = None
        for tenant in tenants:  # every one compared: timing tells nothing of which
            if hmac.compare_digest(alias, self._alias(tenant).encode()):
                found = tenant
        if found is None:
            return None
        expected = self._mac(_list_scope(found), expires).encode()
        valid = hmac.compare_digest(match["mac"].encode(), expected)
        return ListGrant(found, expires) if valid else None


def _list_scope(tenant: str) -> str:
    return f"list:{tenant}"
