"""Model providers for ``llm`` blocks: server configuration, never workflow data.

A workflow names a provider (``"default"`` unless it says otherwise); the provider's
URL, key and cap come only from here, so no tenant can point a call, or the server's
key, anywhere else. ``FLOWCAST_LLM_PROVIDERS`` is a JSON object
``{"name": {"baseUrl", "apiKey"?, "maxConcurrency"?, "timeoutSeconds"?}}``;
``FLOWCAST_LLM_BASE_URL`` / ``FLOWCAST_LLM_API_KEY`` define ``default`` alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from lib.errors import BlockError, FlowcastError, Problem
from lib.workflows.model import Workflow
from lib.workflows.slots import Slots

DEFAULT_PROVIDER = "default"
DEFAULT_MAX_CONCURRENCY = 16
DEFAULT_TIMEOUT_SECONDS = 120.0
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_FIELDS = {"baseUrl", "apiKey", "maxConcurrency", "timeoutSeconds"}


class ProviderConfigError(FlowcastError):
    """``FLOWCAST_LLM_*`` does not describe valid providers; the server does not start."""

    code = "provider_config"


@dataclass(frozen=True, kw_only=True)
class Provider:
    """One OpenAI-compatible chat-completions server."""

    name: str
    base_url: str
    api_key: str | None = field(default=None, repr=False)
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


def parse_providers(
    providers_json: str | None, base_url: str | None = None, api_key: str | None = None
) -> dict[str, Provider]:
    """The configured providers; ProviderConfigError (naming the setting) if one is bad."""
    found: dict[str, Provider] = {}
    if providers_json:
        try:
            raw = orjson.loads(providers_json)
        except orjson.JSONDecodeError as exc:
            raise ProviderConfigError(f"FLOWCAST_LLM_PROVIDERS is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ProviderConfigError("FLOWCAST_LLM_PROVIDERS must be a JSON object of providers")
        for name, spec in raw.items():
            found[name] = _provider(name, spec)
    if base_url:
        if DEFAULT_PROVIDER in found:
            raise ProviderConfigError(
                "the default provider is set twice: by FLOWCAST_LLM_BASE_URL and in "
                "FLOWCAST_LLM_PROVIDERS"
            )
        spec = {"baseUrl": base_url, **({"apiKey": api_key} if api_key else {})}
        found[DEFAULT_PROVIDER] = _provider(DEFAULT_PROVIDER, spec)
    elif api_key:
        raise ProviderConfigError("FLOWCAST_LLM_API_KEY is set without FLOWCAST_LLM_BASE_URL")
    return found


def _provider(name: str, spec: Any) -> Provider:
    where = f"FLOWCAST_LLM_PROVIDERS[{name!r}]"
    if not _NAME.match(name):
        message = "a provider name is 1-64 lowercase letters, digits, _ or -"
        raise ProviderConfigError(f"{where}: {message}")
    if not isinstance(spec, dict):
        raise ProviderConfigError(f"{where} must be an object with baseUrl")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise ProviderConfigError(f"{where}: unknown fields {sorted(unknown)}")
    base_url = spec.get("baseUrl")
    try:
        url = httpx.URL(base_url) if isinstance(base_url, str) else None
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise ProviderConfigError(f"{where}.baseUrl must be an http:// or https:// URL")
    api_key = spec.get("apiKey")
    cap = spec.get("maxConcurrency", DEFAULT_MAX_CONCURRENCY)
    timeout = spec.get("timeoutSeconds", DEFAULT_TIMEOUT_SECONDS)
    if api_key is not None and not isinstance(api_key, str):
        raise ProviderConfigError(f"{where}.apiKey must be a string")
    if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= 10_000:
        raise ProviderConfigError(f"{where}.maxConcurrency must be an integer from 1 to 10000")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ProviderConfigError(f"{where}.timeoutSeconds must be a positive number")
    return Provider(
        name=name,
        base_url=base_url,  # type: ignore[arg-type]  # checked above
        api_key=api_key or None,
        max_concurrency=cap,
        timeout_seconds=float(timeout),
    )


class Providers:
    """The configured providers, the HTTP client that calls them and their shared caps."""

    def __init__(
        self, providers: dict[str, Provider], *, http: httpx.AsyncClient, slots: Slots | None
    ) -> None:
        self._providers = dict(providers)
        self.http = http
        self.slots = slots

    def names(self) -> list[str]:
        return sorted(self._providers)

    def get(self, name: str) -> Provider:
        """The provider called ``name``; a non-retryable BlockError if it is not configured."""
        provider = self._providers.get(name)
        if provider is None:
            raise BlockError("llm_provider_unknown", _unknown(name, self.names()), retryable=False)
        return provider

    def problems(self, workflow: Workflow) -> list[Problem]:
        """Every ``llm`` block of ``workflow`` that names a provider not configured here."""
        return unknown_providers(workflow, self._providers)


def unknown_providers(workflow: Workflow, known: Iterable[str]) -> list[Problem]:
    """Problems for the ``llm`` blocks whose provider is not among ``known``."""
    names = set(known)
    problems = []
    for index, block in enumerate(workflow.blocks):
        if block.type != "llm":
            continue
        name = block.config.get("provider", DEFAULT_PROVIDER)
        if isinstance(name, str) and name not in names:
            path = f"$.blocks[{index}].config.provider"
            problems.append(Problem(path, _unknown(name, sorted(names))))
    return problems


def _unknown(name: str, names: list[str]) -> str:
    if names:
        return f"unknown llm provider {name!r} (configured: {', '.join(names)})"
    if name == DEFAULT_PROVIDER:
        return (
            "no llm provider is configured: set FLOWCAST_LLM_BASE_URL (and "
            "FLOWCAST_LLM_API_KEY) to an OpenAI-compatible server, e.g. "
            "http://127.0.0.1:11434/v1 for Ollama"
        )
    return f"unknown llm provider {name!r}: none is configured (see FLOWCAST_LLM_PROVIDERS)"
