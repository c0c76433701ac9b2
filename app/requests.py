"""Request bodies parsed by orjson.

FastAPI parses a JSON body with the standard library, about ten times slower than orjson,
on the event loop: a 10 MB input held every tenant's requests for most of a second
(step 16's review, row 1). A route of ``JsonRoute`` parses with orjson; a body orjson
refuses (lone surrogates, ``NaN``), or one with a run of 19 or more digits (orjson reads
an integer past 64 bits as a float, losing it), is parsed by the standard library as
before, so what it accepts and how it answers are unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

from lib.slices import decode

_LONG_NUMBER = re.compile(rb"[0-9]{19}")


class _JsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # In pieces with the loop running between them when large (step 16, row 1:
            # parsing 10 MB held every tenant's requests 160-300 ms).
            self._json = await decode(await self.body(), parse_json, _attempt)
        return self._json


def parse_json(body: bytes) -> Any:
    """A JSON body as the standard library reads it, by orjson where that is the same."""
    if not _LONG_NUMBER.search(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # the standard library decides: its value, or its error, as before
    return json.loads(body)


def _attempt(body: bytes) -> Any:
    """``parse_json`` without the standard library's second try when orjson fails: a
    run of a large body cut in the wrong place fails fast (``lib.slices.decode``)."""
    if _LONG_NUMBER.search(body):
        return json.loads(body)
    return orjson.loads(body)


class JsonRoute(APIRoute):
    """An API route whose JSON body is parsed by orjson."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed_fast(request: Request) -> Response:
            return await handler(_JsonRequest(request.scope, request.receive))

        return parsed_fast
