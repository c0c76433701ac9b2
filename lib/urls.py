"""The rule every outbound URL a tenant gives meets first (an ``http`` block's, a
webhook's): absolute, http or https, with a host. Where it may point is checked
separately, at connect time (lib/workflows/blocks/http.py ``allowed_addresses``)."""

from __future__ import annotations

import httpx


def http_url(value: str) -> str:
    """``value`` when it is an absolute http:// or https:// URL; ValueError saying what
    is wrong otherwise."""
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise ValueError(f"not a valid URL: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("must be an absolute http:// or https:// URL")
    return value
