"""``llm``: a chat completion from an OpenAI-compatible server, streamed token by token.

It speaks the chat-completions protocol every such server shares (OpenAI, vLLM, Ollama,
llama.cpp's server, LM Studio, LiteLLM): one POST with ``"stream": true``, then SSE
``data:`` frames, each a chunk whose ``choices[0].delta.content`` is the next piece of
text, a final usage chunk (``stream_options.include_usage``) and ``data: [DONE]``.
Plain httpx and httpx-sse do it (see the README for why not the ``openai`` package):
every failure keeps its response, so ``Retry-After`` and ``x-ratelimit-reset-*`` are
read exactly, and the SDK's own retries never hide an attempt from the event log.

Each text delta is one ``block:chunk``. 429, 408, 5xx, timeouts, a connection that
breaks mid-reply and a reply that ends unfinished are retryable (the executor's
``retry``); an attempt that is retried starts again from its first token. A 429 also
pauses the provider for every replica (``Slots.pause``). The call holds one of the
provider's slots (``maxConcurrency`` across all replicas) while it runs; a call whose
slot lapsed (its process stalled past the lease, or the store lost it) is stopped and
its attempt fails, retryably (``llm_slot_lost``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import httpx
import orjson
from httpx_sse import EventSource, SSEError
from pydantic import Field, field_validator

from lib.errors import BlockError
from lib.execution.events import carriable
from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType, as_text
from lib.workflows.blocks.http import parse_retry_after
from lib.workflows.providers import DEFAULT_PROVIDER, Provider, Providers
from lib.workflows.slots import ProviderPaused, SlotLost
from lib.workflows.templates import is_template

MAX_ERROR_BODY = 64 * 1024
MAX_REPLY_CHARS = 16 * 1024 * 1024
_RETRYABLE_STATUSES = frozenset({408, 409, 429})
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_FENCED = re.compile(r"^\s*```[a-zA-Z]*\s*\n(.*)\n\s*```\s*$", re.DOTALL)
# A wait longer than any retry may wait: the attempt then fails for good.
_LONGEST_WAIT = 10.0**9


class Message(BlockConfig):
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    _content_as_str = field_validator("content", mode="before")(as_text)


class LlmConfig(BlockConfig):
    provider: str = DEFAULT_PROVIDER
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    response_format: Literal["text", "json"] = "text"


def parse_duration(value: str | None) -> float | None:
    """Seconds in an ``x-ratelimit-reset-*`` value (``"1s"``, ``"6m0s"``, ``"20ms"``)."""
    if not value:
        return None
    value = value.strip()
    try:
        return _seconds(float(value))
    except ValueError:
        pass
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    return _seconds(sum(float(number) * _UNITS[unit] for number, unit in parts))


def _seconds(value: float) -> float | None:
    """A wait as a finite number of seconds (an endless one as the longest)."""
    if math.isnan(value):
        return None
    return min(max(0.0, value), _LONGEST_WAIT)


def wait_asked(headers: httpx.Headers) -> float | None:
    """How long a provider asked to wait: ``retry-after-ms``, ``Retry-After``, or the
    reset of the rate limit that ran out (the longest reset if none says so)."""
    if "retry-after-ms" in headers:
        try:
            waited = _seconds(float(headers["retry-after-ms"]) / 1000)
        except ValueError:
            waited = None
        if waited is not None:
            return waited
    asked = parse_retry_after(headers.get("retry-after"))
    if asked is not None:
        return asked
    resets = {
        kind: parse_duration(headers.get(f"x-ratelimit-reset-{kind}"))
        for kind in ("requests", "tokens")
    }
    spent = [
        wait
        for kind, wait in resets.items()
        if wait is not None and headers.get(f"x-ratelimit-remaining-{kind}", "").strip() == "0"
    ]
    known = [wait for wait in resets.values() if wait is not None]
    return max(spent or known) if (spent or known) else None


class Llm(BlockType[LlmConfig]):
    """Streams a chat completion; output ``text``, ``finishReason``, ``model``, ``usage``."""

    name = "llm"
    config_model = LlmConfig
    reads_secrets = True

    def check_raw(self, raw: dict[str, Any]) -> list[tuple[str, str]]:
        # The provider picks a URL and a key: never from data a template could bring.
        if is_template(raw.get("provider")):
            return [(".provider", "must be a provider's name, not a template")]
        return []

    async def run(self, ctx: BlockContext, config: LlmConfig) -> Any:
        providers = ctx.services.llm
        if providers is None:
            raise BlockError(
                "llm_provider_unknown", "no llm provider is configured", retryable=False
            )
        provider = providers.get(config.provider)
        if providers.slots is None:
            reply = await _complete(providers, provider, config, ctx)
        else:
            try:
                async with providers.slots.hold(provider.name, provider.max_concurrency):
                    reply = await _complete(providers, provider, config, ctx)
            except ProviderPaused as paused:
                raise BlockError(
                    "llm_rate_limited", paused.message, retry_after=paused.seconds
                ) from paused
            except SlotLost as lost:
                # Stopped so the cap holds; the attempt is retried as after a broken stream.
                raise BlockError(lost.code, lost.message) from lost
        if config.response_format == "json":
            reply["json"] = _parsed(reply["text"])
        return reply


def _request(config: LlmConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "messages": [message.model_dump() for message in config.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.max_tokens is not None:
        body["max_tokens"] = config.max_tokens
    if config.stop is not None:
        body["stop"] = config.stop
    if config.response_format == "json":
        body["response_format"] = {"type": "json_object"}
    return body


class _Reply:
    """What has arrived of one streamed reply."""

    def __init__(self, model: str) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.finish: str | None = None
        self.model = model
        self.usage = {"promptTokens": 0, "completionTokens": 0}
        self.done = False

    def take(self, chunk: Any, ctx: BlockContext) -> None:
        if not isinstance(chunk, dict):
            raise BlockError("llm_bad_reply", "the provider sent a chunk that is not an object")
        if "error" in chunk:
            raise BlockError("llm_error", f"the provider failed mid-reply: {_error_text(chunk)}")
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            self.model = chunk["model"]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = {
                "promptTokens": _count(usage.get("prompt_tokens")),
                "completionTokens": _count(usage.get("completion_tokens")),
            }
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise BlockError("llm_bad_reply", "the provider sent choices that are not a list")
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(text, str) and text:
                text = carriable(text)
                self.size += len(text)
                if self.size > MAX_REPLY_CHARS:
                    raise BlockError(
                        "llm_reply_too_large",
                        f"the reply is longer than {MAX_REPLY_CHARS} characters",
                        retryable=False,
                    )
                self.parts.append(text)
                ctx.emit_chunk(text)
            if choice.get("finish_reason"):
                self.finish = str(choice["finish_reason"])

    def output(self) -> dict[str, Any]:
        return {
            "text": "".join(self.parts),
            "finishReason": self.finish,
            "model": self.model,
            "usage": self.usage,
        }


async def _complete(
    providers: Providers, provider: Provider, config: LlmConfig, ctx: BlockContext
) -> dict[str, Any]:
    """One call; an error's message never shows the provider's key (a proxy may quote
    the key it got in its error body)."""
    try:
        return await _call(providers, provider, config, ctx)
    except BlockError as exc:
        key = provider.api_key
        if not key or key not in exc.message:
            raise
        masked = exc.message.replace(key, "***")
        raise BlockError(
            exc.code, masked, retryable=exc.retryable, retry_after=exc.retry_after
        ) from None


async def _call(
    providers: Providers, provider: Provider, config: LlmConfig, ctx: BlockContext
) -> dict[str, Any]:
    headers = {"Accept": "text/event-stream", "Idempotency-Key": ctx.idempotency_key}
    if provider.api_key:
        headers["Authorization"] = f"Bearer {provider.api_key}"
    timeout = httpx.Timeout(provider.timeout_seconds, connect=min(10.0, provider.timeout_seconds))
    reply = _Reply(config.model)
    where = f"provider {provider.name!r}"
    try:
        async with providers.http.stream(
            "POST",
            provider.completions_url,
            json=_request(config),
            headers=headers,
            timeout=timeout,
        ) as response:
            if response.status_code != 200:
                raise await _status_error(providers, provider, response)
            media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type == "application/json":
                # A server that ignored "stream": the whole reply at once.
                reply.take(_loads(await response.aread()), ctx)
                reply.done = reply.finish is not None
            else:
                async for event in EventSource(response).aiter_sse():
                    if event.data.strip() == "[DONE]":
                        reply.done = True
                        break
                    if event.data:
                        reply.take(_loads(event.data), ctx)
    except httpx.TimeoutException as exc:
        at = _shown_url(provider.completions_url)
        raise BlockError("llm_timeout", f"{where} at {at} did not answer in time") from exc
    except (httpx.HTTPError, SSEError) as exc:
        # Where it tried, so a person sees a wrong port or a server not started.
        at = _shown_url(provider.completions_url)
        started = "broke off mid-reply" if reply.parts else "could not be reached"
        raise BlockError("llm_unreachable", f"{where} at {at} {started}: {exc}") from exc
    except ValueError as exc:
        raise BlockError("llm_bad_reply", f"{where} sent a chunk that is not JSON") from exc
    if not reply.done and reply.finish is None:
        raise BlockError("llm_unreachable", f"{where} ended the reply before it finished")
    return reply.output()


def _shown_url(url: str) -> str:
    """``url`` without what may be a credential (user, password, query)."""
    try:
        parsed = httpx.URL(url)
        return str(parsed.copy_with(username=None, password=None, query=None, fragment=None))
    except (httpx.InvalidURL, TypeError, ValueError):
        return "(the provider's URL)"


async def _status_error(
    providers: Providers, provider: Provider, response: httpx.Response
) -> BlockError:
    """The BlockError for a non-200 answer; a 429 also pauses the provider everywhere."""
    body = b""
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > MAX_ERROR_BODY:
            break
    status = response.status_code
    detail = _error_text(_json_or_none(body)) or body[:300].decode("utf-8", "replace").strip()
    message = f"provider {provider.name!r} answered {status}" + (f": {detail}" if detail else "")
    wait = wait_asked(response.headers)
    if status == 429 and wait and providers.slots is not None:
        await providers.slots.pause(provider.name, wait)
    retryable = status in _RETRYABLE_STATUSES or status >= 500
    code = "llm_rate_limited" if status == 429 else "llm_status"
    return BlockError(code, message, retryable=retryable, retry_after=wait if retryable else None)


def _parsed(text: str) -> Any:
    """The JSON object a ``responseFormat: "json"`` reply holds (a ```json fence allowed)."""
    fenced = _FENCED.match(text)
    try:
        return orjson.loads(fenced.group(1) if fenced else text)
    except orjson.JSONDecodeError as exc:
        raise BlockError("llm_bad_json", f"the reply is not valid JSON: {exc}") from exc


def _loads(data: str | bytes) -> Any:
    """A chunk's JSON; the standard parser takes the escaped lone surrogates orjson
    refuses (the text is made carriable when it becomes an event)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def _json_or_none(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    return ""


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
