"""``GET /api/executions/{eid}/values/{valueId}``: the full value behind a ref, streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.responses import StreamingResponse

from app.routes.executions import owned_meta
from app.services import Services, services, tenant
from lib.execution.values import check_ids

router = APIRouter(prefix="/api/executions", tags=["values"])


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


@router.get("/{execution_id}/values/{value_id}", response_model=None)
async def get_value(
    execution_id: str,
    value_id: str,
    svc: Annotated[Services, Depends(services)],
    tenant_id: Annotated[str, Depends(tenant)],
) -> StreamingResponse:
    """The value as JSON, streamed in chunks; its sha256 is checked as it goes."""
    check_ids(execution_id, value_id)
    await owned_meta(svc, tenant_id, execution_id)
    chunks = svc.values.read(execution_id, value_id)
    # Read the first chunk before answering, so a missing value is a clean 404.
    first = await anext(chunks, b"")
    return StreamingResponse(
        _prepend(first, chunks),
        media_type="application/json",
        headers={"Cache-Control": "private, max-age=31536000, immutable"},
    )
