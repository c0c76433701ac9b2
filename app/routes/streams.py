"""``GET /api/executions/{eid}/stream``: replay after the cursor, then live, over SSE."""

from __future__ import annotations

import functools
import re
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from app.auth import Caller
from app.errors import ApiError
from app.schemas import API_ERRORS, SSE, STREAM_TOKEN, errors, header, query
from app.services import Services, reader, services
from app.sse import EventStream
from lib.errors import NotFound
from lib.execution.stream import StreamReader

router = APIRouter(prefix="/api/executions", tags=["executions"])

_CURSOR = re.compile(r"^[0-9]{1,18}$")
# The buffer's Lua adds one to the cursor and prints it with "%.14g": from 10**14 on
# that is "1e+14", which Redis refuses as a stream id (a 503 instead of a 400).
MAX_CURSOR = 10**14 - 2
CURSOR = {"type": "integer", "minimum": 0, "maximum": MAX_CURSOR}


def parse_cursor(value: str | None, name: str) -> int:
    """A non-negative integer cursor, or a 400 that says what was wrong."""
    if value is None or value == "":
        return 0
    if not _CURSOR.match(value.strip()):
        raise ApiError(
            400, "invalid_cursor", f"{name} must be a non-negative integer, got {value!r}"
        )
    number = int(value)
    if number > MAX_CURSOR:
        raise ApiError(400, "invalid_cursor", f"{name} must be at most {MAX_CURSOR}, got {value!r}")
    return number


def sse_response(
    svc: Services,
    execution_id: str,
    *,
    cursor: int,
    tenant: str,
    slot_taken: bool = False,
    reader: StreamReader | None = None,
) -> EventStream:
    """The SSE response for one execution from ``cursor`` on (or ``reader``'s, already
    opened), counted among the tenant's open streams (429 past the cap) until it ends."""
    if reader is None:
        reader = _reader(svc, execution_id, cursor)
    if not slot_taken:
        try:
            svc.streams.take(tenant)
        except BaseException:
            reader.detach()
            raise
    return EventStream(
        reader,
        streams=svc.open_streams,
        release=functools.partial(svc.streams.give_back, tenant),
        execution_id=execution_id,
    )


def _reader(svc: Services, execution_id: str, cursor: int) -> StreamReader:
    return svc.readers.reader(execution_id, cursor=cursor)


@router.get(
    "/{execution_id}/stream",
    response_model=None,
    status_code=200,  # FastAPI reads it from the response class's __init__ otherwise
    response_class=EventStream,  # for the docs: the 200 is text/event-stream only
    responses={
        200: {"content": SSE, "description": "Replay after the cursor, then live"},
        204: {"description": "The execution is finished and the cursor is at its end"},
        **errors(400, 404, 429, *API_ERRORS),
    },
    openapi_extra={
        "parameters": [
            query("lastEventId", CURSOR, "Replay after this event id"),
            header("Last-Event-ID", CURSOR, "Replay after this event id (wins over the query)"),
            STREAM_TOKEN,
        ]
    },
)
async def stream(
    execution_id: str,
    request: Request,
    svc: Annotated[Services, Depends(services)],
    caller: Annotated[Caller, Depends(reader)],
) -> Response:
    header = request.headers.get("last-event-id")
    if header is not None:
        cursor = parse_cursor(header, "Last-Event-ID")
    else:
        cursor = parse_cursor(request.query_params.get("lastEventId"), "lastEventId")
    reader = _reader(svc, execution_id, cursor)
    meta = await reader.open()
    if not caller.may_read(meta.tenant, execution_id):
        reader.detach()
        raise NotFound("execution", execution_id)
    if meta.finished and cursor == meta.last_id:
        reader.detach()
        # 204 tells EventSource the stream is over and not to reconnect. A cursor above
        # the stored terminal event saw ids that were never stored: it gets the terminal
        # event instead (SPEC §5), never a bare 204.
        return Response(status_code=204, headers={"X-Execution-Id": execution_id})
    return sse_response(svc, execution_id, cursor=cursor, tenant=meta.tenant, reader=reader)
