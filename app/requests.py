"""Request bodies read in one place: refused in Flowcast's words when they are not JSON,
parsed by orjson, in slices when large (``lib/parsing.py``).

FastAPI parses a JSON body with the standard library, about ten times slower than orjson,
on the event loop: a 10 MB input held every tenant's requests for most of a second
(step 16's review, row 1). A route of ``JsonRoute`` parses with ``decode_json``: orjson,
cut at commas into runs with the loop running between them; a body orjson refuses
(lone surrogates, ``NaN``), or one with a run of 19 or more digits, is parsed by the
standard library as before, so what it accepts is unchanged.

What a person sent wrong is said so they can fix it (step 18, issue 26): a body that is
not labelled JSON is 415 "send Content-Type: application/json" (FastAPI handed the
route the raw bytes, which ended as "Type is not JSON serializable: bytes"), and bad
JSON is 422 "invalid JSON at line 2, column 7: …" (not ``$[40]`` "JSON decode error").
The body is read here, inside the route: after ``KeysFirst`` refused a request without a
valid key, so an unauthenticated body is still never read (SPEC §8). Fields the route's
model does not take are worded by ``app/errors.py``, which reads ``body_keys``.
"""

from __future__ import annotations

import email.message
import json
import types
import typing
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from app.errors import ApiError, InvalidRequest
from lib.errors import Problem
from lib.parsing import decode_json

SEND_JSON = "send Content-Type: application/json with a JSON body"


class _JsonRequest(Request):
    async def read_json(self) -> None:
        """Parse the body now, if there is one; our errors when it is not JSON."""
        body = await self.body()
        if not body:
            return  # no body: the route's default (an execute without input)
        _refuse_unless_json(self.headers.get("content-type"))
        try:
            # In pieces with the loop running between them when large (step 16, row 1:
            # parsing 10 MB held every tenant's requests 160-300 ms).
            self._json = await decode_json(body)
        except json.JSONDecodeError as exc:
            message = f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            raise InvalidRequest(message, [Problem("$", message)]) from None
        except UnicodeDecodeError as exc:
            message = f"the body is not UTF-8 text (byte {exc.start + 1} cannot be read)"
            raise InvalidRequest(message, [Problem("$", message)]) from None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            await self.read_json()
        return getattr(self, "_json", None)


def _refuse_unless_json(content_type: str | None) -> None:
    # Strict on purpose: a form or text/plain POST is what a page on another site may
    # send a loopback server without asking first (no CORS preflight).
    if content_type:
        parsed = email.message.Message()
        parsed["content-type"] = content_type
        subtype = parsed.get_content_subtype()
        if parsed.get_content_maintype() == "application" and (
            subtype == "json" or subtype.endswith("+json")
        ):
            return
    got = f"got {content_type.split(';')[0].strip()!r}" if content_type else "got none"
    raise ApiError(415, "unsupported_media_type", f"{SEND_JSON} ({got})")


def body_keys(annotation: Any) -> tuple[str, ...]:
    """The fields a body model takes, as a client spells them (empty for ``Any``)."""
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    for candidate in (annotation, *candidates):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return tuple(field.alias or name for name, field in candidate.model_fields.items())
    return ()


class JsonRoute(APIRoute):
    """An API route whose JSON body is read by ``_JsonRequest`` (orjson, our errors)."""

    body_keys: tuple[str, ...] = ()

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None
        if self.body_field is not None:
            self.body_keys = body_keys(self.body_field.field_info.annotation)

        async def parsed_fast(request: Request) -> Response:
            json_request = _JsonRequest(request.scope, request.receive)
            if takes_body:
                # Here, not in FastAPI's reader: its errors would be a 400 "There was an
                # error parsing the body" or the raw bytes handed to the route.
                await json_request.read_json()
            return await handler(json_request)

        return parsed_fast
