"""Request bodies parsed by orjson, in slices when large (``lib/slices.py``).

FastAPI parses a JSON body with the standard library, about ten times slower than orjson,
on the event loop: a 10 MB input held every tenant's requests for most of a second
(step 16's review, row 1). A route of ``JsonRoute`` parses with ``decode_json``: orjson,
cut at commas into runs with the loop running between them; a body orjson refuses
(lone surrogates, ``NaN``), or one with a run of 19 or more digits, is parsed by the
standard library as before, so what it accepts and how it answers are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from lib.slices import decode_json


class _JsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # In pieces with the loop running between them when large (step 16, row 1:
            # parsing 10 MB held every tenant's requests 160-300 ms).
            self._json = await decode_json(await self.body())
        return self._json


class JsonRoute(APIRoute):
    """An API route whose JSON body is parsed by orjson."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed_fast(request: Request) -> Response:
            return await handler(_JsonRequest(request.scope, request.receive))

        return parsed_fast
