"""``http``: one outbound HTTP request, refused for private addresses unless allowed.

Unless ``http_allow_private`` is set, every hop of a request goes through the same
steps: the host is resolved once (``BlockServices.resolve``, by default
``loop.getaddrinfo``), the request is refused if *any* answer is private, loopback,
link-local, reserved, multicast, unspecified, shared (CGNAT) or a cloud metadata
address, and the request is then sent to that checked address itself. Pinning the
address means a DNS server that answers differently at connect time (rebinding)
cannot steer the request elsewhere: the URL carries the IP literal, the ``Host``
header the original name, and for https the ``sni_hostname`` extension makes httpcore
send the original name as SNI and verify the certificate against it.

Redirects (301, 302, 303, 307, 308) are followed here rather than by httpx, up to
``MAX_REDIRECTS`` hops, so each hop is checked and pinned the same way; credentials
(``Authorization``, ``Cookie``, …) are dropped when a redirect changes the origin.

Known limits: httpcore 1.0 honours ``sni_hostname`` on direct and SOCKS connections
but not inside an HTTP proxy's CONNECT tunnel, so https through such a proxy fails
certificate verification (it fails closed). Pinned https requests are sent with
``Connection: close`` (see ``_send``), trading keep-alive for a certificate check per
name. URLs may carry userinfo; messages show them without it (``shown``).
"""

from __future__ import annotations

import asyncio
import email.utils
import ipaddress
import json
import socket
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx
from pydantic import Field, field_validator

from lib.errors import BlockError
from lib.parsing import decode_json
from lib.urls import http_url
from lib.workflows.blocks.base import (
    BlockConfig,
    BlockContext,
    BlockServices,
    BlockType,
    IPAddress,
    Resolver,
)

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_REDIRECTS = 5
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_METADATA = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
# The well-known NAT64 prefix maps the whole IPv4 space; judge the embedded address.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


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
        return http_url(value)


def is_refused_address(address: IPAddress) -> bool:
    """Whether an address is private, loopback, link-local, reserved, metadata, …"""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return is_refused_address(address.ipv4_mapped)
        if address in _NAT64:
            return is_refused_address(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if address.sixtofour is not None and is_refused_address(address.sixtofour):
            return True
        if address.is_site_local:
            return True
    return (
        address in _METADATA
        or not address.is_global
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or address.is_link_local
        or address.is_loopback
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


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    """Every address ``loop.getaddrinfo`` gives for ``host``, in its order, without repeats."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0])) for info in infos))


def shown(url: httpx.URL) -> str:
    """A URL as it may appear in messages: without its userinfo."""
    return str(url.copy_with(username=None, password=None))


def _parse_url(raw: str | httpx.URL) -> httpx.URL:
    try:
        url = httpx.URL(raw)
    except httpx.InvalidURL as exc:
        raise BlockError("bad_url", f"not a valid URL: {exc}", retryable=False) from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise BlockError(
            "bad_url",
            f"only absolute http:// and https:// URLs are allowed, not {url.scheme}: URLs",
            retryable=False,
        )
    return url


def _default_port(url: httpx.URL) -> int:
    return url.port or (443 if url.scheme == "https" else 80)


def _same_origin(a: httpx.URL, b: httpx.URL) -> bool:
    return (a.scheme, a.raw_host, _default_port(a)) == (b.scheme, b.raw_host, _default_port(b))


async def allowed_addresses(url: httpx.URL, resolve: Resolver, timeout: float) -> list[IPAddress]:
    """The addresses to connect to for ``url``; refuses if any of them is not public."""
    host = url.raw_host.decode("ascii")
    try:
        addresses: list[IPAddress] = [ipaddress.ip_address(host)]
    except ValueError:
        addresses = await _resolve(resolve, host, _default_port(url), timeout)
    for address in addresses:
        if is_refused_address(address):
            raise BlockError(
                "address_refused",
                f"{host!r} resolves to {address}, a private or reserved address; "
                "set FLOWCAST_HTTP_ALLOW_PRIVATE=true to allow it",
                retryable=False,
            )
    return addresses


async def _resolve(resolve: Resolver, host: str, port: int, timeout: float) -> list[IPAddress]:
    try:
        async with asyncio.timeout(timeout):
            addresses = list(await resolve(host, port))
    except TimeoutError as exc:
        raise BlockError("http_timeout", f"resolving {host!r} timed out") from exc
    except OSError as exc:
        raise BlockError("http_error", f"cannot resolve {host!r}: {exc}") from exc
    if not addresses:
        raise BlockError("http_error", f"{host!r} resolves to no address")
    return addresses


@dataclass(frozen=True)
class _Hop:
    """One request of a redirect chain."""

    method: str
    url: httpx.URL
    headers: httpx.Headers
    body: Any
    send_body: bool

    def redirected(self, status: int, location: str) -> _Hop:
        """The next hop for a redirect answer, as browsers and httpx do it."""
        try:
            target = _parse_url(self.url.join(location))
        except httpx.InvalidURL as exc:
            raise BlockError(
                "bad_url", f"invalid redirect location: {exc}", retryable=False
            ) from exc
        headers = httpx.Headers(self.headers)
        method, send_body = self.method, self.send_body
        if (status == 303 and method != "HEAD") or (status in (301, 302) and method == "POST"):
            method, send_body = "GET", False
            for name in ("Content-Length", "Transfer-Encoding"):
                headers.pop(name, None)
        if not _same_origin(self.url, target):
            # Credentials given for one origin must not reach another.
            for name in ("Authorization", "Proxy-Authorization", "Cookie", "Host"):
                headers.pop(name, None)
        return _Hop(method, target, headers, self.body if send_body else None, send_body)


class Http(BlockType[HttpConfig]):
    """Sends the request; 429 and 5xx are retryable and honour ``Retry-After``."""

    name = "http"
    config_model = HttpConfig
    reads_secrets = True

    async def run(self, ctx: BlockContext, config: HttpConfig) -> Any:
        headers = httpx.Headers(config.headers)
        # Every attempt and every re-run after a recovery sends the same key, so the
        # remote side can deduplicate; a key the workflow sets itself wins.
        headers.setdefault("Idempotency-Key", ctx.idempotency_key)
        send_body = "body" in config.model_fields_set
        hop = _Hop(config.method, _parse_url(config.url), headers, config.body, send_body)
        for redirects in range(MAX_REDIRECTS + 1):
            label = f"{hop.method} {shown(hop.url)}"
            try:
                response, content = await _send(ctx.services, hop, config.timeout_ms / 1000)
            except httpx.TimeoutException as exc:
                raise BlockError("http_timeout", f"{label} timed out") from exc
            except UnicodeEncodeError as exc:
                # Its message would show the character and where it is (maybe a secret's).
                message = "a header name or value has characters HTTP headers cannot carry"
                raise BlockError("bad_config", message, retryable=False) from exc
            except httpx.HTTPError as exc:
                raise BlockError("http_error", f"{label} failed: {exc}") from exc
            location = response.headers.get("location")
            if response.status_code not in _REDIRECT_STATUSES or location is None:
                break
            if redirects == MAX_REDIRECTS:
                raise BlockError(
                    "too_many_redirects",
                    f"{label} redirected more than {MAX_REDIRECTS} times",
                    retryable=False,
                )
            hop = hop.redirected(response.status_code, location)
        if response.status_code == 429 or response.status_code >= 500:
            raise BlockError(
                "http_status",
                f"{label} answered {response.status_code}",
                retryable=True,
                retry_after=parse_retry_after(response.headers.get("retry-after")),
            )
        return {
            "status": response.status_code,
            "headers": {name.lower(): value for name, value in response.headers.items()},
            "body": await _body(response, content),
        }


async def _send(services: BlockServices, hop: _Hop, timeout: float) -> tuple[httpx.Response, bytes]:
    """One hop: checked and pinned unless private addresses are allowed."""
    if services.http_allow_private:
        return await _exchange(services, hop, timeout, {})
    resolve = services.resolve or system_resolver
    addresses = await allowed_addresses(hop.url, resolve, timeout)
    headers = httpx.Headers(hop.headers)
    headers.setdefault("Host", hop.url.netloc.decode("ascii"))
    extensions: dict[str, Any] = {}
    if hop.url.scheme == "https":
        extensions["sni_hostname"] = hop.url.raw_host.decode("ascii")
        # The pool keys connections by IP, not by name: a kept-alive connection whose
        # certificate was checked for one name must not serve another name.
        headers["Connection"] = "close"
    for address in addresses[:-1]:
        pinned = replace(hop, url=hop.url.copy_with(host=str(address)), headers=headers)
        try:
            return await _exchange(services, pinned, timeout, extensions)
        except httpx.ConnectError:
            continue  # nothing was sent; the next checked address may answer
    pinned = replace(hop, url=hop.url.copy_with(host=str(addresses[-1])), headers=headers)
    return await _exchange(services, pinned, timeout, extensions)


async def _exchange(
    services: BlockServices, hop: _Hop, timeout: float, extensions: dict[str, Any]
) -> tuple[httpx.Response, bytes]:
    async with services.http_limiter:
        async with services.http.stream(
            hop.method,
            hop.url,
            headers=hop.headers,
            json=hop.body if hop.send_body else None,
            timeout=timeout,
            follow_redirects=False,
            extensions=extensions,
        ) as response:
            return response, await _read_capped(response)


async def _body(response: httpx.Response, content: bytes) -> Any:
    """The response's JSON when it says it is JSON, else its text.

    UTF-8 JSON is parsed from the bytes in slices (``lib.parsing.decode_json``): the
    standard library's parse of 35 MB held the event loop for seconds (step 16's
    review, row 1). Anything else (another charset, bytes that are no UTF-8, no JSON)
    is decoded and parsed as before."""
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    is_json = media_type == "application/json" or media_type.endswith("+json")
    charset = (response.encoding or "utf-8").lower().replace("_", "-")
    # A BOM or a NUL in the first bytes: the standard library would guess another
    # encoding from the bytes; the text below reads them as they were read before.
    if is_json and charset in _UTF8 and not content.startswith(_BOM) and b"\0" not in content[:4]:
        try:
            return await decode_json(content)
        except ValueError:
            pass  # decided below, as before
    text = content.decode(response.encoding or "utf-8", errors="replace")
    if is_json:
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


_UTF8 = frozenset({"utf-8", "utf8"})
_BOM = b"\xef\xbb\xbf"


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
