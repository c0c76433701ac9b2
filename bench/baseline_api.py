"""The bare endpoint of the ``starts`` row's ratios (SPEC section 11): a plain FastAPI
``POST`` of the same shape as Flowcast's execute, with no Redis and no workflow.

Run in its own process: ``uvicorn --factory bench.baseline_api:create_app``, with the
same uvicorn options as the Flowcast replica it is compared with.

``POST /api/workflows/{workflow_id}/execute`` parses the JSON body into a pydantic model
of the same fields as Flowcast's (``input``, ``inlineFiles``, unknown fields refused)
and answers 202 with a JSON body of the same fields and about the same size as
Flowcast's queued answer (``executionId``, ``status``, ``ahead``, ``streamUrl``,
``streamToken``), encoded with orjson as Flowcast's is. Nothing is stored: it is what a
request of that shape costs this HTTP stack, the floor a start is measured against.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

import orjson
from fastapi import Body, FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field


class ExecuteRequest(BaseModel):
    """The same fields as Flowcast's execute body."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    input: Any = None
    inline_files: bool = Field(False, alias="inlineFiles")


def create_app() -> FastAPI:
    """The bare app (a factory, so nothing is built at import time)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/readyz")
    async def ready() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.post("/api/workflows/{workflow_id}/execute", status_code=202)
    async def execute(
        workflow_id: str, body: Annotated[ExecuteRequest | None, Body()] = None
    ) -> Response:
        _ = body or ExecuteRequest()
        execution_id = "ex_" + secrets.token_urlsafe(18)  # the length of Flowcast's ids
        answer = {
            "executionId": execution_id,
            "status": "queued",
            "ahead": 0,
            "streamUrl": f"/api/executions/{execution_id}/stream",
            # A stream token's length: expiry, then a MAC.
            "streamToken": f"{int(time.time()) + 3600}.{secrets.token_urlsafe(32)}",
        }
        return Response(orjson.dumps(answer), status_code=202, media_type="application/json")

    return app
