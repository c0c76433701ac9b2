"""``flowcast demo-model``: an offline OpenAI-compatible model for demos and first runs.

No model is behind it. ``POST /v1/chat/completions`` answers every request with a reply
worked out from its messages alone, the same reply for the same messages, so a
newcomer can run every ``llm`` example without Ollama or an API key::

    flowcast demo-model                                   # http://127.0.0.1:11435/v1
    FLOWCAST_LLM_BASE_URL=http://127.0.0.1:11435/v1 flowcast serve

It speaks the protocol the ``llm`` block speaks (lib/workflows/blocks/llm.py): a
``chat.completion`` object, or with ``"stream": true`` a ``text/event-stream`` of
``chat.completion.chunk`` events (the role first, one word per chunk, a finish chunk,
a usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``).
``max_tokens`` cuts the reply (``finish_reason`` ``length``), ``stop`` ends it at the
first stop sequence, and ``response_format`` ``json_object`` is answered with a JSON
object (whole: never cut, so that it parses). ``GET /v1/models`` lists the one model,
``demo`` (any model name is accepted).

The tests' scriptable fake (tests/support/llm.py) is another thing: it misbehaves on
request; this one never does.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DEFAULT_PORT = 11435
MODEL = "demo"
# The reply is cut at this many words when ``max_tokens`` does not cut it first.
MAX_WORDS = 400
JSON_FORMATS = ("json_object", "json_schema")


def reply_text(messages: list[dict[str, Any]]) -> str:
    """The demo's reply to ``messages``: the same text for the same messages."""
    asked = _last(messages, "user") or "(no question)"
    system = _last(messages, "system")
    digest = hashlib.sha256(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)).hexdigest()
    words = asked.split()
    shown = " ".join(words[:40]) + (" …" if len(words) > 40 else "")
    told = f" Its instructions: “{_clip(system, 30)}”" if system else ""
    return (
        "This is Flowcast's demo model, with no real model behind it. "
        f"You asked: “{shown}” ({len(words)} word{'' if len(words) == 1 else 's'}).{told} "
        "A real model would answer here; "
        f"this reply is the same every time for the same messages (digest {digest[:8]})."
    )


def reply_json(messages: list[dict[str, Any]], model: str) -> str:
    """The reply as a JSON object, for ``response_format`` ``json_object``."""
    asked = _last(messages, "user")
    text = reply_text(messages)
    value = {
        "answer": text,
        "question": _clip(asked, 40),
        "words": len(asked.split()),
        "model": model,
        "demo": True,
    }
    return orjson.dumps(value).decode()


def _last(messages: list[dict[str, Any]], role: str) -> str:
    for message in reversed(messages):
        if message.get("role") == role:
            return _content(message.get("content"))
    return ""


def _content(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        return " ".join(part for part in parts if isinstance(part, str))
    return ""


def _clip(text: str, words: int) -> str:
    split = text.split()
    return " ".join(split[:words]) + (" …" if len(split) > words else "")


def _pieces(text: str) -> list[str]:
    """The reply as the deltas a stream sends: one word each, with its leading space."""
    words = text.split(" ")
    return [words[0], *(" " + word for word in words[1:])]


class _Completion:
    """One request's reply: its text (cut by ``max_tokens`` and ``stop``) and usage."""

    def __init__(self, body: dict[str, Any]) -> None:
        messages = body["messages"]
        self.model = str(body.get("model") or MODEL)
        self.id = "chatcmpl-demo-" + hashlib.sha256(orjson.dumps(messages)).hexdigest()[:12]
        wanted = body.get("response_format")
        asked_json = isinstance(wanted, dict) and wanted.get("type") in JSON_FORMATS
        text = reply_json(messages, self.model) if asked_json else reply_text(messages)
        self.finish = "stop"
        if not asked_json:  # a JSON reply is sent whole, so that it parses
            text = self._cut(text, body)
        self.text = text
        self.pieces = _pieces(text) if text else []
        prompt = sum(len(_content(m.get("content")).split()) for m in messages)
        self.usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.pieces),
            "total_tokens": prompt + len(self.pieces),
        }

    def _cut(self, text: str, body: dict[str, Any]) -> str:
        """``text`` cut at ``max_tokens`` words (``length``) and at the first ``stop``."""
        pieces = _pieces(text)
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        cap = min(limit, MAX_WORDS) if isinstance(limit, int) and limit > 0 else MAX_WORDS
        if len(pieces) > cap:
            pieces, self.finish = pieces[:cap], "length"
        text = "".join(pieces)
        stops = body.get("stop")
        for stop in [stops] if isinstance(stops, str) else stops or []:
            if isinstance(stop, str) and stop and stop in text:
                text, self.finish = text[: text.index(stop)], "stop"
        return text

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.text},
                    "finish_reason": self.finish,
                }
            ],
            "usage": self.usage,
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    async def stream(self, *, usage: bool, seconds_per_word: float) -> AsyncIterator[bytes]:
        yield self.chunk({"role": "assistant", "content": ""})
        for piece in self.pieces:
            if seconds_per_word:
                await asyncio.sleep(seconds_per_word)  # the pace of a model's tokens
            yield self.chunk({"content": piece})
        yield self.chunk({}, self.finish)
        if usage:
            tail = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": self.model,
                "choices": [],
                "usage": self.usage,
            }
            yield b"data: " + orjson.dumps(tail) + b"\n\n"
        yield b"data: [DONE]\n\n"


def _error(status: int, message: str) -> JSONResponse:
    """An error as the OpenAI API words one."""
    body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
    return JSONResponse(body, status_code=status)


def create_demo_app(*, words_per_second: float = 20.0) -> Starlette:
    """The demo model's ASGI app; streamed replies go at ``words_per_second`` (0: at once)."""
    seconds_per_word = 1 / words_per_second if words_per_second > 0 else 0.0

    async def completions(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "messages must be a non-empty list")
        if not all(isinstance(message, dict) for message in messages):
            return _error(400, "each message must be an object")
        completion = _Completion(body)
        if not body.get("stream"):
            return JSONResponse(completion.whole())
        options = body.get("stream_options") or {}
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return StreamingResponse(
            completion.stream(usage=usage, seconds_per_word=seconds_per_word),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def models(request: Request) -> Response:
        model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "flowcast"}
        return JSONResponse({"object": "list", "data": [model]})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )
