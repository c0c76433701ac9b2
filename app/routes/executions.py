"""``/api/executions``: list, snapshot and the JSON page of events."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.errors import ApiError
from app.idempotency import Outcome
from app.limits import check_large_input, checked_input
from app.requests import JsonRoute
from app.responses import JSON
from app.routes.streams import CURSOR, parse_cursor
from app.schemas import (
    API_ERRORS,
    IDEMPOTENCY_KEY,
    Accepted,
    EventPage,
    ExecutionList,
    Snapshot,
    errors,
    json_example,
    query,
)
from app.services import Services, services, tenant
from lib.errors import NotFound
from lib.execution.events import TERMINAL_STATUSES
from lib.execution.indexes import Before, created_ms
from lib.execution.listing import ListFilter
from lib.execution.record import ExecutionMeta
from lib.workflows.runner import Started as Run

router = APIRouter(prefix="/api/executions", tags=["executions"], route_class=JsonRoute)

ServicesDep = Annotated[Services, Depends(services)]
TenantDep = Annotated[str, Depends(tenant)]

STATUSES = frozenset({"queued", "running", "paused", *TERMINAL_STATUSES})
MAX_PAGE = 1_000


def snapshot(meta: ExecutionMeta) -> dict[str, Any]:
    """The public view of an execution's metadata."""
    view: dict[str, Any] = {
        "id": meta.id,
        "workflowId": meta.workflow_id,
        "status": meta.status,
        "createdAt": meta.created_at,
        "updatedAt": meta.updated_at,
        "lastEventId": meta.last_id,
        "firstRetainedEventId": meta.first_id,
    }
    for name in ("output", "error", "pause"):
        value = getattr(meta, name)
        if value is not None:
            view[name] = value
    if meta.decision:
        view["decision"] = meta.decision
    return view


async def owned_meta(svc: Services, tenant_id: str, execution_id: str) -> ExecutionMeta:
    """The execution's metadata if the caller's tenant owns it; 404 otherwise."""
    meta = await svc.buffer.meta(execution_id)
    if meta.tenant != tenant_id:
        raise NotFound("execution", execution_id)
    return await svc.buffer.resolved(meta)


def _bounded_int(value: str | None, name: str, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    number = parse_cursor(value, name)
    if not low <= number <= high:
        raise ApiError(400, "invalid_parameter", f"{name} must be between {low} and {high}")
    return number


# The filters of the list, read by list_filter (here and on the live list).
LIST_PARAMETERS = [
    query("workflowId", {"type": "string"}, "Only this workflow's executions"),
    query("status", {"enum": sorted(STATUSES)}, "Only executions in this status"),
    query("limit", {"type": "integer", "minimum": 1, "maximum": 200}, "At most this many"),
]


def list_filter(params: Mapping[str, str]) -> ListFilter:
    """The list's filters from the query string; 400 that says what was wrong."""
    limit = _bounded_int(params.get("limit"), "limit", 20, 1, 200)
    status = params.get("status")
    if status is not None and status not in STATUSES:
        raise ApiError(400, "invalid_parameter", f"status must be one of {sorted(STATUSES)}")
    return ListFilter(limit=limit, workflow_id=params.get("workflowId"), status=status)


# A page further back: a creation ms, or a page's ``nextBefore`` (``<ms>:<execution id>``).
_BEFORE = re.compile(r"(\d{1,15})(?::(ex_[A-Za-z0-9_-]{1,64}))?")
BEFORE = query(
    "before",
    {"type": "string", "pattern": f"^{_BEFORE.pattern}$", "example": "1764712800000"},
    "Only executions listed after this cursor: a creation time in ms since the epoch "
    "(those created before it), or the nextBefore of the previous page",
)


def parse_before(value: str | None) -> Before | None:
    """The ``before`` cursor of a list page; a 400 that says what was wrong."""
    if value is None:
        return None
    found = _BEFORE.fullmatch(value)
    if found is None:
        raise ApiError(
            400,
            "invalid_parameter",
            "before must be a time in ms since the epoch or a previous page's nextBefore "
            f"(<ms>:<execution id>), got {value[:80]!r}",
        )
    return Before(int(found.group(1)), found.group(2))


def next_before(metas: list[ExecutionMeta], limit: int) -> str | None:
    """The cursor of the page after ``metas``; None when this page was the last."""
    if len(metas) < limit:
        return None
    last = metas[-1]
    return f"{created_ms(last.created_at)}:{last.id}"


@router.get(
    "",
    responses={200: {"model": ExecutionList}, **errors(400, *API_ERRORS)},
    openapi_extra={"parameters": [*LIST_PARAMETERS, BEFORE]},
)
async def list_executions(request: Request, svc: ServicesDep, tenant_id: TenantDep) -> JSON:
    wanted = list_filter(request.query_params)
    before = parse_before(request.query_params.get("before"))
    found = await svc.buffer.recent_metas(
        tenant_id,
        limit=wanted.limit,
        workflow_id=wanted.workflow_id,
        status=wanted.status,
        before=before,
    )
    resolved = await asyncio.gather(*(svc.buffer.resolved(meta) for meta in found))
    views = [with_token(svc, snapshot(meta)) for meta in resolved]
    for view, meta in zip(views, resolved, strict=True):
        await place_in_line(svc, view, meta)
    return JSON({"executions": views, "nextBefore": next_before(found, wanted.limit)})


def with_token(svc: Services, view: dict[str, Any]) -> dict[str, Any]:
    """With API keys, the view carries a ``streamToken`` for the execution's stream, as
    the live list's rows do: the page opens a run found in a list page or by its id with
    an EventSource, which cannot send the key."""
    if svc.keys.enabled:
        view["streamToken"] = svc.tokens.issue(view["id"])
    return view


@router.get(
    "/{execution_id}",
    responses={200: {"model": Snapshot}, **errors(404, *API_ERRORS)},
)
async def get_execution(execution_id: str, svc: ServicesDep, tenant_id: TenantDep) -> JSON:
    meta = await owned_meta(svc, tenant_id, execution_id)
    return JSON(await place_in_line(svc, with_token(svc, snapshot(meta)), meta))


async def place_in_line(svc: Services, view: dict[str, Any], meta: ExecutionMeta) -> dict[str, Any]:
    """A queued execution's view says about how many start before it (``ahead``)."""
    if meta.status == "queued":
        ahead = await svc.runner.dispatcher.ahead(meta.tenant, meta.id)
        if ahead is not None:
            view["ahead"] = ahead
    return view


@router.get(
    "/{execution_id}/events",
    responses={200: {"model": EventPage}, **errors(400, 404, *API_ERRORS)},
    openapi_extra={
        "parameters": [
            query("after", CURSOR, "Events after this id"),
            query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}, "Page size"),
        ]
    },
)
async def list_events(
    execution_id: str, request: Request, svc: ServicesDep, tenant_id: TenantDep
) -> JSON:
    """One page of stored events after ``after``, as JSON."""
    after = parse_cursor(request.query_params.get("after"), "after")
    limit = _bounded_int(request.query_params.get("limit"), "limit", 100, 1, MAX_PAGE)
    page = await svc.buffer.read(execution_id, after=after, limit=limit)
    if page.meta.tenant != tenant_id:
        raise NotFound("execution", execution_id)
    tail = orjson.dumps(
        {
            "nextAfter": page.events[-1].id if page.events else after,
            "firstRetainedEventId": page.meta.first_id,
            "lastEventId": page.meta.last_id,
            "status": page.meta.status,
        }
    )
    # The stored envelopes are sent as they are, without decoding them.
    body = b'{"events":[' + b",".join(event.json for event in page.events) + b"]," + tail[1:]
    return JSON(body)


class ResumeRequest(BaseModel):
    """Body of ``POST /api/executions/{eid}/resume``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    block_id: str | None = Field(None, alias="blockId")
    input: Any = None

    @field_validator("input")
    @classmethod
    def _carriable(cls, value: Any) -> Any:
        return checked_input(value)


def _answer(outcome: Outcome) -> JSON:
    return JSON(outcome.body, status_code=outcome.status)


@router.post(
    "/{execution_id}/resume",
    status_code=202,
    responses={
        202: {"model": Accepted, "description": "Resumed"},
        **errors(400, 404, 409, 413, 415, 422, 429, *API_ERRORS),
    },
    openapi_extra={
        "parameters": [IDEMPOTENCY_KEY],
        **json_example({"blockId": "review", "input": {"approved": True, "note": "ok"}}),
    },
)
async def resume(
    execution_id: str,
    request: Request,
    svc: ServicesDep,
    tenant_id: TenantDep,
    body: Annotated[ResumeRequest, Body()],
) -> JSON:
    """Answer a pause; exactly one of many concurrent resumes is accepted."""
    await check_large_input(body.input)

    async def resume() -> Run:
        return await svc.runner.resume(
            execution_id, tenant=tenant_id, block_id=body.block_id, input=body.input
        )

    outcome = await svc.idempotency.accept(
        request,
        tenant=tenant_id,
        operation=f"resume:{execution_id}",
        scope=execution_id,
        action=resume,
    )
    return _answer(outcome)


@router.post(
    "/{execution_id}/cancel",
    status_code=202,
    responses={
        202: {"model": Accepted, "description": "Cancelling"},
        **errors(400, 404, 409, 422, *API_ERRORS),
    },
    openapi_extra={"parameters": [IDEMPOTENCY_KEY]},
)
async def cancel(
    execution_id: str, request: Request, svc: ServicesDep, tenant_id: TenantDep
) -> JSON:
    """Cancel a running or paused execution, wherever it runs."""

    async def cancel() -> Run:
        return await svc.runner.cancel(execution_id, tenant=tenant_id)

    outcome = await svc.idempotency.accept(
        request,
        tenant=tenant_id,
        operation=f"cancel:{execution_id}",
        scope=execution_id,
        action=cancel,
    )
    return _answer(outcome)
