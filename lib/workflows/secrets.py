"""Tenants' secrets: encrypted at rest, readable only by the runs of their own tenant.

A secret is stored in its tenant's Redis hash, encrypted with AES-256-GCM (the
``cryptography`` package) under a key derived by HKDF-SHA256 from the server's secret
key. The tenant and the name are the associated data, so a value copied to another
tenant's hash or under another name does not decrypt. No route ever returns a value:
only ``reveal`` does, for a run of the same tenant whose templates read it.

Wherever a revealed value could come back out (a block's output, its streamed chunks,
an error message, a log line), ``Redactor`` puts ``***`` in its place. Every value
this process revealed is also remembered (boundedly) for ``redact_text``, which the
log formatter applies to every line.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import secrets
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import httpx
import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from redis.asyncio import Redis

from lib.backend import Keys, translating
from lib.errors import BlockError, InvalidInput, NotFound, Problem

MASK = "***"
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_VALUE_BYTES = 64 * 1024
MAX_SECRETS = 1000
MAX_SECRETS_PER_WORKFLOW = 64
# How many values a process masks in its log lines: the most recently revealed.
_REMEMBERED = 1_000
_HEAD = 4
_DIRECT = 32
_PIECES_UP_TO = 64 * 1024


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

    def __init__(self, *, redis: Redis, key: bytes, prefix: str = "fc") -> None:
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"flowcast secrets v1"
        ).derive(key)
        self._aead = AESGCM(derived)
        self._redis = redis
        self._keys = Keys(prefix)
        self._revealed: OrderedDict[str, None] = OrderedDict()
        self._mask = Redactor()

    async def put(self, tenant: str, name: str, value: str) -> tuple[SecretInfo, bool]:
        """Store ``value`` as ``name``; the secret's listing, and whether it is new."""
        check_name(name)
        plain = value.encode("utf-8", "surrogatepass")
        if not plain:
            raise InvalidInput("empty secret", [Problem("$.value", "a secret cannot be empty")])
        if len(plain) > MAX_VALUE_BYTES:
            raise InvalidInput(
                "secret too large",
                [Problem("$.value", f"a secret is at most {MAX_VALUE_BYTES} bytes")],
            )
        nonce = secrets.token_bytes(12)
        sealed = self._aead.encrypt(nonce, plain, _aad(tenant, name))
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
        info = SecretInfo(name, now.replace("+00:00", "Z"))
        stored = orjson.dumps(
            {"at": info.updated_at, "sealed": base64.b64encode(nonce + sealed).decode()}
        )
        key = self._keys.secrets(tenant)
        with translating("store the secret"):
            full = await self._redis.hlen(key) >= MAX_SECRETS
            if full and not await self._redis.hexists(key, name):
                raise InvalidInput(
                    "too many secrets",
                    [Problem("name", f"a tenant may keep at most {MAX_SECRETS} secrets")],
                )
            created = bool(await self._redis.hset(key, name, stored))
        return info, created

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
            values[name] = self._open(tenant, name, raw)
        self._remember(list(values.values()))
        return values

    def _open(self, tenant: str, name: str, raw: bytes) -> str:
        try:
            blob = base64.b64decode(orjson.loads(raw)["sealed"])
            plain = self._aead.decrypt(blob[:12], blob[12:], _aad(tenant, name))
        except (InvalidTag, KeyError, ValueError, TypeError) as exc:
            raise BlockError(
                "secret_unreadable",
                f"secret {name!r} cannot be decrypted: was FLOWCAST_SECRET_KEY changed?",
                retryable=False,
            ) from exc
        return plain.decode("utf-8", "surrogatepass")

    def _remember(self, values: Sequence[str]) -> None:
        fresh = [value for value in values if value not in self._revealed]
        for value in values:
            self._revealed[value] = None
            self._revealed.move_to_end(value)
        if len(self._revealed) > _REMEMBERED:
            while len(self._revealed) > _REMEMBERED:
                self._revealed.popitem(last=False)
            self._mask = Redactor(self._revealed)
        elif fresh:
            self._mask.add(fresh)

    def redact_text(self, text: str) -> str:
        """``text`` with every value this process revealed replaced by ``***``."""
        return self._mask.text(text)


def _aad(tenant: str, name: str) -> bytes:
    return f"{tenant}\x00{name}".encode()


class Redactor:
    """Replaces known secret values in text, JSON values and streamed chunks.

    No regular expression: each text is searched for the spellings it may hold. With
    many spellings, a short text (a log line, a chunk) is first cut into the 4-character
    pieces a spelling can start with, so masking costs about the text's length, not
    the number of secrets a process ever revealed.
    """

    def __init__(self, values: Any = ()) -> None:
        self._values: set[str] = set()
        self._ordered: list[str] = []  # longest first: a value holding another goes whole
        self._heads: dict[str, list[str]] = {}
        self._short: list[str] = []
        self.add(values)

    def __bool__(self) -> bool:
        return bool(self._values)

    @property
    def values(self) -> frozenset[str]:
        """Every spelling masked."""
        return frozenset(self._values)

    def add(self, values: Any) -> None:
        """Mask these values from now on, also in the spellings a request gives them."""
        fresh = {
            spelling
            for value in values
            if value
            for spelling in _spellings(value)
            if spelling not in self._values
        }
        if not fresh:
            return
        self._values |= fresh
        self._ordered = sorted(self._values, key=len, reverse=True)
        self._heads = {}
        self._short = []
        for spelling in self._ordered:
            if len(spelling) < _HEAD:
                self._short.append(spelling)
            else:
                self._heads.setdefault(spelling[:_HEAD], []).append(spelling)

    def text(self, text: str) -> str:
        if not self._ordered:
            return text
        if len(self._ordered) <= _DIRECT or len(text) > _PIECES_UP_TO:
            candidates = self._ordered
        else:
            pieces = {text[i : i + _HEAD] for i in range(len(text) - _HEAD + 1)}
            found = [s for head in pieces & self._heads.keys() for s in self._heads[head]]
            candidates = sorted([*found, *self._short], key=len, reverse=True)
        for spelling in candidates:
            if len(spelling) <= len(text) and spelling in text:
                text = text.replace(spelling, MASK)
        return text

    def value(self, value: Any) -> Any:
        """A JSON value with secrets masked in every string (keys included)."""
        if not self._ordered:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(item) for k, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        return value

    def stream(self) -> ChunkRedactor:
        return ChunkRedactor(self)


def _spellings(value: str) -> set[str]:
    """``value`` as it may come back: as is, percent-encoded (a URL, a form), escaped
    in JSON text, in base64. Other transformations cannot be recognized."""
    spellings = {
        value,
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote(value, safe="/:@!$&'()*+,;=?~"),
        urllib.parse.quote_plus(value),
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(value)[1:-1],
        base64.b64encode(value.encode("utf-8", "surrogatepass")).decode(),
        *_in_url(value),
    }
    # Too short to mask without masking everything else too.
    return {spelling for spelling in spellings if len(spelling) >= min(4, len(value))}


def _in_url(value: str) -> set[str]:
    """``value`` as httpx writes it into a URL's path and query (it leaves some
    characters as they are that urllib would encode, and encodes others)."""
    found: set[str] = set()
    try:
        url = httpx.URL("http://h/p" + value + "?q=" + value)
    except (httpx.InvalidURL, UnicodeError, ValueError):
        return found
    path, _, query = url.raw_path.decode("ascii", "replace").partition("?")
    found.add(path.removeprefix("/p"))
    found.add(query.removeprefix("q="))
    return found


class ChunkRedactor:
    """Masks secrets in a stream of chunks, also when one is split across chunks.

    The end of a chunk that could be the start of a secret is held back until the next
    chunk shows whether it is; ``flush`` gives what is left when the stream ends.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor
        self._held = ""

    def feed(self, chunk: str) -> str:
        if not self._redactor:
            return chunk
        text = self._redactor.text(self._held + chunk)
        keep = self._prefix_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep] if keep else text

    def flush(self) -> str:
        held, self._held = self._held, ""
        return self._redactor.text(held)

    def _prefix_tail(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some secret."""
        longest = 0
        for value in self._redactor.values:
            for size in range(min(len(value) - 1, len(text)), longest, -1):
                if value.startswith(text[len(text) - size :]):
                    longest = size
                    break
        return longest
