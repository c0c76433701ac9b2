"""Stream tokens: signed, scoped to one execution (or one tenant's list), expiring.

Browsers' EventSource cannot send headers, so the SSE and values routes also accept
``?token=``. A token is ``<expiry>.<hmac>`` where the HMAC covers the execution id and
the expiry, so it is useless for any other execution or after it expires.

The live list of executions takes a list token, ``<tenant>.<expiry>.<hmac>``: the HMAC
covers ``list:<tenant>`` and the expiry. No execution id contains ``:``, so neither kind
of token ever passes for the other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from pathlib import Path

# What ``issue`` writes: decimal ASCII seconds, a dot, an unpadded urlsafe-base64 SHA-256.
# Checking the shape first keeps ``check`` total: ``str.isdigit`` and ``int`` accept
# other digits (``²``, fullwidth ones) and ``compare_digest`` raises on non-ASCII text, so a
# hostile query string must never reach them as anything but a plain "no".
_TOKEN = re.compile(r"(?P<expires>[0-9]{1,15})\.(?P<mac>[A-Za-z0-9_-]{43})")
_LIST_TOKEN = re.compile(
    r"(?P<tenant>[A-Za-z0-9_]{1,64})\.(?P<expires>[0-9]{1,15})\.(?P<mac>[A-Za-z0-9_-]{43})"
)


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
        message = f"{execution_id}.{expires}".encode()
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def issue(self, execution_id: str, *, now: float | None = None) -> str:
        expires = int((time.time() if now is None else now) + self._lifetime)
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
        return f"{tenant}.{expires}.{self._mac(_list_scope(tenant), expires)}"

    def list_tenant(self, token: str, *, now: float | None = None) -> str | None:
        """The tenant whose list ``token`` opens, or None if it is not a valid one."""
        match = _LIST_TOKEN.fullmatch(token)
        if match is None:
            return None
        tenant = match["tenant"]
        expires = int(match["expires"])
        if expires < (time.time() if now is None else now):
            return None
        expected = self._mac(_list_scope(tenant), expires).encode()
        return tenant if hmac.compare_digest(match["mac"].encode(), expected) else None


def _list_scope(tenant: str) -> str:
    return f"list:{tenant}"
