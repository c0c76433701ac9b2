"""``/api/executions/live``: the tenant's recent executions over SSE, kept up to date.

Its router is included before ``/api/executions/{eid}``'s, which would take ``live``
for an execution id (no execution has it: ids start with ``ex_``).
"""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from app.responses import JSON
from app.routes.executions import LIST_PARAMETERS, list_filter
from app.schemas import API_ERRORS, SSE, LiveToken, errors, query
from app.services import Services, lister, services, tenant
from app.sse import EventStream
from app.tokens import ListGrant
from lib.execution.listing import ListReader

router = APIRouter(prefix="/api/executions", tags=["executions"])

ServicesDep = Annotated[Services, Depends(services)]
LIVE_URL = "/api/executions/live"
LIST_TOKEN = query(
    "token",
    {"type": "string"},
    "A list token from POST /api/executions/live/token, instead of an API key "
    "(EventSource cannot send headers)",
)


@router.post("/live/token", responses={200: {"model": LiveToken}, **errors(*API_ERRORS)})
async def live_list_token(svc: ServicesDep, tenant_id: Annotated[str, Depends(tenant)]) -> JSON:
    """A token that opens the caller's live list (``?token=``), for clients that cannot
    send an Authorization header; it expires after ``FLOWCAST_STREAM_TOKEN_SECONDS``."""
    token = svc.tokens.issue_list(tenant_id)
    return JSON({"streamUrl": LIVE_URL, "streamToken": token})


@router.get(
    "/live",
    response_model=None,
    status_code=200,  # FastAPI reads it from the response class's __init__ otherwise
    response_class=EventStream,  # for the docs: the 200 is text/event-stream only
    responses={
        200: {"content": SSE, "description": "The list, then each status change"},
        **errors(400, 429, *API_ERRORS),
    },
    openapi_extra={"parameters": [*LIST_PARAMETERS, LIST_TOKEN]},
)
async def live_list(
    request: Request, svc: ServicesDep, grant: Annotated[ListGrant, Depends(lister)]
) -> EventStream:
    """The caller's recent executions (the filters of ``GET /api/executions``), then one
    frame per status change (started, paused, resumed, recovered, finished), from
    whichever replica runs the execution. Frames, none with an ``id:``:

    - ``executions``: ``{"executions": [row, …]}``, newest first: the whole list (sent
      first, and again whenever changes may have been missed or a full list lost a
      row to its status filter); replace what you have.
    - ``execution``: one ``row``: insert or update it; keep the rows newest first by
      ``createdAt``, at most ``limit``.
    - ``execution:unlisted``: ``{"id", "status"}``: it left the status filter; drop it.

    A row is ``{"id", "workflowId", "status", "createdAt", "updatedAt", "lastEventId"}``
    (no frame takes a row shown back to an older state), plus a ``streamToken`` for
    that execution's stream when the server has API keys. The stream counts among the
    tenant's ``FLOWCAST_MAX_STREAMS_PER_TENANT``. Opened with a list token, it ends when
    the token expires, and the rows' tokens expire no later.
    """
    wanted = list_filter(request.query_params)
    tenant_id = grant.tenant
    svc.streams.take(tenant_id)
    release = functools.partial(svc.streams.give_back, tenant_id)
    stream_token = functools.partial(svc.tokens.issue, not_after=grant.expires)
    reader = ListReader(
        buffer=svc.buffer,
        feed=svc.hub.statuses,
        tenant=tenant_id,
        wanted=wanted,
        stream_token=stream_token if svc.keys.enabled else None,
    )
    try:
        await reader.open()
    except BaseException:
        release()
        raise
    return EventStream(reader, streams=svc.open_streams, release=release, ends_at=grant.expires)
