"""``GET /api/executions/{eid}/values/{valueId}``: the full value behind a ref, streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import StreamingResponse

from app.auth import Caller
from app.schemas import API_ERRORS, STREAM_TOKEN, errors
from app.services import Services, reader, services
from lib.errors import NotFound
from lib.execution.values import check_ids

router = APIRouter(prefix="/api/executions", tags=["values"])


async def _prepend(head: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in head:
        yield chunk
    async for chunk in rest:
        yield chunk


async def _take(chunks: AsyncIterator[bytes], count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        chunk = await anext(chunks, None)
        if chunk is None:
            return
        yield chunk


@router.get(
    "/{execution_id}/values/{value_id}",
    response_model=None,
    responses={
        200: {"content": {"application/json": {"schema": {}}}, "description": "The value"},
        **errors(404, *API_ERRORS),
    },
    openapi_extra={"parameters": [STREAM_TOKEN]},
)
async def get_value(
    execution_id: str,
    value_id: str,
    svc: Annotated[Services, Depends(services)],
    caller: Annotated[Caller, Depends(reader)],
) -> StreamingResponse:
    """The value as JSON, streamed in chunks; its sha256 is checked as it goes."""
    check_ids(execution_id, value_id)
    meta = await svc.buffer.meta(execution_id)
    if not caller.may_read(meta.tenant, execution_id):
        raise NotFound("execution", execution_id)
    chunks = svc.values.read(execution_id, value_id)
    # Read two chunks before answering: a missing value is then a clean 404, and a
    # value of one chunk is checked against its sha256 before the status is sent.
    head = [chunk async for chunk in _take(chunks, 2)]
    return StreamingResponse(
        _prepend(head, chunks),
        media_type="application/json",
        headers={"Cache-Control": "private, max-age=31536000, immutable"},
    )
