"""``http``: one outbound HTTP request, refused for private addresses unless allowed.

Redirects are not followed: a 3xx is returned as the output, so an allowed public host
cannot bounce the request to a private one. The address check resolves the host itself;
httpx resolves it again when connecting, so this guards against configuration mistakes
and plain SSRF, not against a hostile DNS server that answers differently each time.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import ipaddress
import json
import socket
import time
from typing import Any, Literal

import httpx
from pydantic import Field, field_validator

from lib.errors import BlockError
from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_METADATA = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class HttpConfig(BlockConfig):
    method: Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"] = "GET"
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    body: Any = Field(None, alias="json")
    timeout_ms: int = Field(30_000, ge=1, le=3_600_000)

    @field_validator("method", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        try:
            url = httpx.URL(value)
        except httpx.InvalidURL as exc:
            raise ValueError(f"not a valid URL: {exc}") from exc
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("must be an absolute http:// or https:// URL")
        return value


def idempotency_key(execution_id: str, block_id: str) -> str:
    """The key every attempt of one block in one execution sends."""
    return hashlib.sha256(f"{execution_id}\x00{block_id}".encode()).hexdigest()[:32]


def is_refused_address(address: IPAddress) -> bool:
    """Whether an address is private, loopback, link-local, reserved, metadata, …"""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (
        address in _METADATA
        or not address.is_global
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    current = time.time() if now is None else now
    return max(0.0, moment.timestamp() - current)


async def _check_address(host: str, port: int) -> None:
    try:
        addresses: list[IPAddress] = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise BlockError("http_error", f"cannot resolve {host!r}: {exc}") from exc
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for address in addresses:
        if is_refused_address(address):
            raise BlockError(
                "address_refused",
                f"{host!r} resolves to {address}, a private or reserved address; "
                "set FLOWCAST_HTTP_ALLOW_PRIVATE=true to allow it",
                retryable=False,
            )


def _body(response: httpx.Response, content: bytes) -> Any:
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    text = content.decode(response.encoding or "utf-8", errors="replace")
    if media_type == "application/json" or media_type.endswith("+json"):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


class Http(BlockType[HttpConfig]):
    """Sends the request; 429 and 5xx are retryable and honour ``Retry-After``."""

    name = "http"
    config_model = HttpConfig

    async def run(self, ctx: BlockContext, config: HttpConfig) -> Any:
        services = ctx.services
        url = httpx.URL(config.url)
        if not services.http_allow_private:
            await _check_address(url.host, url.port or (443 if url.scheme == "https" else 80))
        headers = dict(config.headers)
        if not any(name.lower() == "idempotency-key" for name in headers):
            headers["Idempotency-Key"] = idempotency_key(ctx.execution_id, ctx.block_id)
        send_body = "body" in config.model_fields_set
        try:
            async with services.http_limiter:
                async with services.http.stream(
                    config.method,
                    url,
                    headers=headers,
                    json=config.body if send_body else None,
                    timeout=config.timeout_ms / 1000,
                    follow_redirects=False,
                ) as response:
                    content = await _read_capped(response)
        except httpx.TimeoutException as exc:
            raise BlockError("http_timeout", f"{config.method} {url} timed out") from exc
        except httpx.HTTPError as exc:
            raise BlockError("http_error", f"{config.method} {url} failed: {exc}") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise BlockError(
                "http_status",
                f"{config.method} {url} answered {response.status_code}",
                retryable=True,
                retry_after=parse_retry_after(response.headers.get("retry-after")),
            )
        return {
            "status": response.status_code,
            "headers": {name.lower(): value for name, value in response.headers.items()},
            "body": _body(response, content),
        }


async def _read_capped(response: httpx.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise BlockError(
                "response_too_large",
                f"the response is larger than {MAX_RESPONSE_BYTES} bytes",
                retryable=False,
            )
        chunks.append(chunk)
    return b"".join(chunks)
