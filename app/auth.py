"""API keys and stream tokens.

With ``FLOWCAST_API_KEYS`` set, every ``/api`` route needs ``Authorization: Bearer
<key>``. Each key is a tenant, named by a hash of the key (so no key ever appears in a
Redis key name or a log line); a tenant sees only its own workflows and executions.
The SSE and values routes also accept ``?token=`` with a ``streamToken``, which grants
access to the one execution it was issued for; the live list of executions accepts a
list token, which grants its tenant's list; ``?token=`` anywhere else is 401.
Without keys everything is one open tenant, ``default``, answered on loopback only and
never through a proxy (:class:`LoopbackOnly`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.datastructures import QueryParams
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import ApiError, error_payload
from app.limits import carries_body
from app.responses import JSON
from app.tokens import ListGrant, StreamTokens

DEFAULT_TENANT = "default"
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def tenant_of_key(key: str) -> str:
    """The tenant a key stands for: a hash of it, never the key itself."""
    return "t_" + hashlib.sha256(key.encode()).hexdigest()[:24]


class ApiKeys:
    """The configured keys; empty means the API is open."""

    def __init__(self, raw: str | None) -> None:
        self._keys = [key.strip().encode() for key in (raw or "").split(",") if key.strip()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, presented: str) -> str | None:
        """The tenant of a presented key, compared in constant time, or None."""
        candidate = presented.encode()
        found: bytes | None = None
        for key in self._keys:
            # Compare against every key so timing tells nothing about which matched.
            if hmac.compare_digest(candidate, key):
                found = key
        return tenant_of_key(found.decode()) if found is not None else None

    def tenants(self) -> list[str]:
        """The tenants of the configured keys (a key taken out of the configuration
        takes its tenant's list tokens with it)."""
        return [tenant_of_key(key.decode()) for key in self._keys]


@dataclass(frozen=True)
class Caller:
    """Who is asking: a tenant, or the holder of a token for one execution."""

    tenant: str | None
    execution_id: str | None = None

    def may_read(self, execution_tenant: str, execution_id: str) -> bool:
        if self.execution_id is not None:
            return self.execution_id == execution_id
        return self.tenant == execution_tenant


def _bearer(request: Request, keys: ApiKeys) -> str:
    return _bearer_of(request.headers.get("authorization", ""), keys)


def _presented(header: str) -> str:
    """The key an ``Authorization`` header presents as a bearer token ("" for none)."""
    scheme, _, presented = header.partition(" ")
    return presented.strip() if scheme.lower() == "bearer" else ""


def _bearer_of(header: str, keys: ApiKeys) -> str:
    presented = _presented(header)
    if not presented:
        raise ApiError(
            401, "unauthorized", "an API key is required (Authorization: Bearer <key>)", CHALLENGE
        )
    tenant = keys.tenant(presented)
    if tenant is None:
        raise ApiError(401, "unauthorized", "the API key is not valid", CHALLENGE)
    return tenant


def authenticate(request: Request, keys: ApiKeys) -> str:
    """The caller's tenant on a route that takes only API keys."""
    if not keys.enabled:
        return DEFAULT_TENANT
    if "token" in request.query_params:
        raise ApiError(
            401,
            "unauthorized",
            "a stream token is accepted only on stream, value and live list routes",
            CHALLENGE,
        )
    return _bearer(request, keys)


def authenticate_reader(
    request: Request, keys: ApiKeys, tokens: StreamTokens, execution_id: str
) -> Caller:
    """The caller on the SSE and values routes: an API key or a stream token."""
    if not keys.enabled:
        return Caller(DEFAULT_TENANT)
    token = request.query_params.get("token")
    if token is None:
        return Caller(_bearer(request, keys))
    if not tokens.check(token, execution_id):
        raise ApiError(
            401, "unauthorized", "the stream token is not valid for this execution", CHALLENGE
        )
    return Caller(None, execution_id)


def authenticate_list(request: Request, keys: ApiKeys, tokens: StreamTokens) -> ListGrant:
    """The caller on the live list: an API key (no end), or a list token (until it expires)."""
    if not keys.enabled:
        return ListGrant(DEFAULT_TENANT, None)
    token = request.query_params.get("token")
    if token is None:
        return ListGrant(_bearer(request, keys), None)
    grant = tokens.list_grant(token, keys.tenants())
    if grant is None:
        raise ApiError(
            401,
            "unauthorized",
            "the list token is not valid (POST /api/executions/live/token issues one)",
            CHALLENGE,
        )
    return grant


class Callers:
    """Names a request's caller for its turn (app/limits.py ``Turns``), before any route
    runs: the tenant of a configured key however its ``Authorization`` is spelled, the
    tenant of a valid list token, the execution of a valid stream token, and one shared
    name for everything else (no keys, no valid key or token).

    Step 16's fresh-eyes review: keyed by the header's bytes, one key spelled 1,500 ways
    (``bearer``/``BEARER``, more spaces before the key) was 1,500 callers, each with its
    own turns and its own place in the gate, and another tenant's GET waited behind all
    of them (2.3 s, against 0.17 s beside 1,500 spelled one way); a keyless client
    sending a made-up key per request did the same.
    """

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    def __call__(self, scope: Scope) -> bytes:
        if not self.keys.enabled:
            return b""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is not None:
            presented = _presented(header.decode("latin-1"))
            tenant = self.keys.tenant(presented) if presented else None
            return b"tenant:" + tenant.encode() if tenant else b""
        token = QueryParams(scope.get("query_string", b"")).get("token")
        services = getattr(scope["app"].state, "services", None) if "app" in scope else None
        if token is None or services is None:
            return b""
        tokens: StreamTokens = services.tokens
        grant = tokens.list_grant(token, self.keys.tenants())
        if grant is not None:
            return b"tenant:" + grant.tenant.encode()
        parts = str(scope.get("path", "")).split("/")
        if parts[1:3] == ["api", "executions"] and len(parts) > 3 and tokens.check(token, parts[3]):
            return b"execution:" + parts[3].encode()
        return b""


# Headers a proxy adds when it relays a request for someone else (RFC 7239's Forwarded,
# RFC 9110's Via, and the de facto X-Forwarded-* and X-Real-IP).
RELAY_HEADERS = frozenset({b"forwarded", b"via", b"x-real-ip"})


class KeysFirst:
    """ASGI middleware with API keys set: a request that carries a body is answered 401
    before a byte of it is read, unless its ``Authorization`` names a configured key.
    Step 16's review: eight keyless clients sending 10 MiB bodies of ``[{},{},…]`` added
    ~300 MiB and pushed another tenant's p99 to 1.25-3.5 s, every body read and parsed
    before its key was checked. (No route that takes a ``?token=`` takes a body.)"""

    def __init__(self, app: ASGIApp, *, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and carries_body(scope["headers"]):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            try:
                _bearer_of(header.decode("latin-1"), self.keys)
            except ApiError as error:
                status, body = error_payload(error)
                # Closed after the answer: the body it did not read is still on its way.
                headers = {**(error.headers or {}), "Connection": "close"}
                await JSON(body, status_code=status, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LoopbackOnly:
    """ASGI middleware for a server without API keys: it answers this machine only.

    ``flowcast serve`` refuses to bind anything else without keys; this holds the same
    line when the factory is started some other way (``uvicorn --host 0.0.0.0``): a
    request that reached a non-loopback address of this machine gets 403. So does a
    request relayed by a proxy: a proxy on this machine reaches the server on loopback
    and would open it to everyone who can reach the proxy. (A relay that adds no such
    header, a bare TCP forward, cannot be told apart: the README says not to.)
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := _refusal(scope)) is not None:
            error = ApiError(403, "loopback_only", refusal)
            status, body = error_payload(error)
            await JSON(body, status_code=status)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _refusal(scope: Scope) -> str | None:
    """Why a keyless server must not answer this request, or None."""
    reason = "this server has no FLOWCAST_API_KEYS, so it answers on loopback only"
    if not _is_loopback(scope.get("server")):
        return reason
    relayed = _relay_header(scope.get("headers", []))
    if relayed is not None:
        return (
            f"{reason}, and this request was relayed by a proxy ({relayed} header): "
            "set FLOWCAST_API_KEYS to serve behind a proxy"
        )
    return None


def _relay_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, _ in headers:
        if name in RELAY_HEADERS or name.startswith(b"x-forwarded-"):
            return name.decode("latin-1")
    return None


def _is_loopback(server: Any) -> bool:
    if not server:
        return True  # a unix socket or an in-process transport: not reachable from afar
    host = str(server[0])
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
