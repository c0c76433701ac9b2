"""Stream tokens: signed, scoped to one execution, expiring.

Browsers' EventSource cannot send headers, so the SSE and values routes also accept
``?token=``. A token is ``<expiry>.<hmac>`` where the HMAC covers the execution id and
the expiry, so it is useless for any other execution or after it expires.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from pathlib import Path


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
        expires = int((now or time.time()) + self._lifetime)
        return f"{expires}.{self._mac(execution_id, expires)}"

    def check(self, token: str, execution_id: str, *, now: float | None = None) -> bool:
        """True when the token was issued for this execution and has not expired."""
        expires_text, _, mac = token.partition(".")
        if not expires_text.isdigit() or not mac:
            return False
        expires = int(expires_text)
        if expires < (now or time.time()):
            return False
        return hmac.compare_digest(mac, self._mac(execution_id, expires))
