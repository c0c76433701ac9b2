"""What a webhook is: a URL and the events it wants (SPEC §15), and the address rule.

The ``http`` block's rule applies: unless private addresses are allowed, a URL whose
host is a private, loopback, link-local, reserved or metadata address (or ``localhost``)
is refused when the workflow is stored and when an execution is started (422 with its
path). A name is resolved only at delivery, where every address it resolves to is
checked again and the request is pinned to a checked one (deliver.py): a name that
resolves elsewhere later is caught there.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lib.errors import Problem
from lib.execution.events import (
    EXECUTION_CANCELLED,
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_PAUSED,
    EXECUTION_RECOVERED,
    EXECUTION_RESUMED,
    EXECUTION_STARTED,
)
from lib.urls import http_url

# The events a webhook may ask for: those of the execution as a whole.
EVENTS = (
    EXECUTION_STARTED,
    EXECUTION_PAUSED,
    EXECUTION_RESUMED,
    EXECUTION_RECOVERED,
    EXECUTION_COMPLETED,
    EXECUTION_FAILED,
    EXECUTION_CANCELLED,
)
# Unless a webhook says otherwise: the ends, and a pause (a person may be needed).
DEFAULT_EVENTS = (EXECUTION_COMPLETED, EXECUTION_FAILED, EXECUTION_CANCELLED, EXECUTION_PAUSED)
MAX_WEBHOOKS = 10
MAX_URL_CHARS = 2048


class Webhook(BaseModel):
    """One webhook: where to POST, and which events."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(max_length=MAX_URL_CHARS)
    events: list[str] = Field(default_factory=lambda: list(DEFAULT_EVENTS), min_length=1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return http_url(value)

    @field_validator("events")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in EVENTS]
        if unknown:
            raise ValueError(f"unknown events {unknown}; known: {', '.join(EVENTS)}")
        return list(dict.fromkeys(value))


def address_problems(hooks: Sequence[Webhook], path: str, *, allow_private: bool) -> list[Problem]:
    """A problem for each webhook whose URL names a refused address (nothing resolved)."""
    if allow_private:
        return []
    from lib.workflows.blocks.http import is_refused_address  # the http block's rule

    problems = []
    for index, hook in enumerate(hooks):
        host = httpx.URL(hook.url).host
        name = host.rstrip(".")
        refused = name == "localhost" or name.endswith(".localhost")
        address = _literal(host)
        if address is not None:
            refused = refused or is_refused_address(address)
        # else a name: checked against what it resolves to at delivery
        if refused:
            problems.append(
                Problem(
                    f"{path}[{index}].url",
                    f"{host!r} is a private or reserved address; "
                    "set FLOWCAST_HTTP_ALLOW_PRIVATE=true to allow it",
                )
            )
    return problems


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` is, also in the forms the resolver reads as one without
    asking DNS (inet_aton: ``127.1``, ``2130706433``, ``0x7f000001``, ``0``); None for
    a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not host or not all(c.isalnum() or c in ".xX" for c in host) or not host[0].isdigit():
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def encoded(hooks: Sequence[Webhook]) -> str:
    """The webhooks as an execution's metadata keeps them ("" for none)."""
    if not hooks:
        return ""
    import orjson

    return orjson.dumps([hook.model_dump() for hook in hooks]).decode()


def decoded(raw: str | bytes | None) -> list[Webhook]:
    """The webhooks an execution's metadata keeps."""
    if not raw:
        return []
    import orjson

    items: list[dict[str, Any]] = orjson.loads(raw)
    return [Webhook.model_validate(item) for item in items]
