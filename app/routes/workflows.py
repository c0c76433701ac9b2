"""``/api/workflows``: create, read, list, delete, and execute."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.idempotency import WriteBack
from app.limits import check_large_input, checked_input, unstorable
from app.requests import JsonRoute
from app.responses import JSON
from app.routes.streams import sse_response
from app.schemas import (
    API_ERRORS,
    IDEMPOTENCY_KEY,
    SSE,
    Started,
    WorkflowDocument,
    WorkflowList,
    errors,
    json_example,
    workflow_body,
)
from app.services import Services, services, tenant
from lib.backend import Batch
from lib.errors import InvalidInput, Problem, WorkflowChanged
from lib.webhooks.spec import Webhook, address_problems
from lib.workflows.model import Workflow
from lib.workflows.runner import Started as Run

router = APIRouter(prefix="/api/workflows", tags=["workflows"], route_class=JsonRoute)

ServicesDep = Annotated[Services, Depends(services)]
TenantDep = Annotated[str, Depends(tenant)]


class ExecuteRequest(BaseModel):
    """Body of ``POST /api/workflows/{id}/execute``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    input: Any = None
    inline_files: bool = Field(False, alias="inlineFiles")
    webhook: Webhook | None = None

    @field_validator("input")
    @classmethod
    def _carriable(cls, value: Any) -> Any:
        return checked_input(value)


def _summary(workflow: Workflow, source: str) -> dict[str, Any]:
    return {
        "id": workflow.id,
        "name": workflow.name,
        "description": workflow.description,
        "blocks": len(workflow.blocks),
        "source": source,
    }


def _document(workflow: Workflow) -> dict[str, Any]:
    return workflow.model_dump(by_alias=True, exclude_none=True, mode="json")


@router.get("", responses={200: {"model": WorkflowList}, **errors(*API_ERRORS)})
async def list_workflows(svc: ServicesDep, tenant_id: TenantDep) -> JSON:
    stored = await svc.workflows.list(tenant_id)
    return JSON({"workflows": [_summary(item.workflow, item.source) for item in stored]})


@router.put(
    "/{workflow_id}",
    responses={
        200: {"model": WorkflowDocument, "description": "Replaced"},
        201: {"model": WorkflowDocument, "description": "Created"},
        **errors(413, 415, 422, 429, *API_ERRORS),
    },
    openapi_extra=workflow_body(),
)
async def put_workflow(
    workflow_id: str,
    svc: ServicesDep,
    tenant_id: TenantDep,
    body: Annotated[Any, Body()],
) -> JSON:
    if (problem := unstorable(body)) is not None:
        raise InvalidInput("the workflow cannot be stored as JSON", [Problem("$", problem)])
    workflow, created = await svc.workflows.put(tenant_id, workflow_id, body)
    return JSON(_document(workflow), status_code=201 if created else 200)


@router.get(
    "/{workflow_id}",
    responses={200: {"model": WorkflowDocument}, **errors(404, *API_ERRORS)},
)
async def get_workflow(workflow_id: str, svc: ServicesDep, tenant_id: TenantDep) -> JSON:
    stored = await svc.workflows.get(tenant_id, workflow_id)
    return JSON({**_document(stored.workflow), "source": stored.source})


@router.delete(
    "/{workflow_id}",
    status_code=204,
    responses=errors(404, 409, *API_ERRORS),
)
async def delete_workflow(workflow_id: str, svc: ServicesDep, tenant_id: TenantDep) -> Response:
    await svc.workflows.delete(tenant_id, workflow_id)
    return Response(status_code=204)


def _starter(
    svc: Services,
    tenant_id: str,
    workflow_id: str,
    request_body: ExecuteRequest,
    *,
    first_stored: bool,
) -> Callable[[str, WriteBack | None], Awaitable[Run]]:
    """What starts the execution, once its Idempotency-Key allows, under the id given."""

    async def run(
        workflow: Workflow,
        execution_id: str,
        write_back: WriteBack | None,
        confirm: Callable[[Batch], None] | None,
    ) -> Run:
        if request_body.webhook is not None:
            hook_problems = [
                Problem(problem.path.replace("[0]", ""), problem.message)
                for problem in address_problems(
                    [request_body.webhook],
                    "$.webhook",
                    allow_private=svc.settings.http_allow_private,
                )
            ]
            if hook_problems:
                raise InvalidInput("the webhook's address is refused", hook_problems)
        missing = svc.providers.problems(workflow)
        if missing:
            refused = InvalidInput("the workflow needs an llm provider this server lacks", missing)
            refused.code = "llm_provider_unknown"
            raise refused
        return await svc.runner.start(
            workflow,
            input=request_body.input,
            tenant=tenant_id,
            inline_files=request_body.inline_files,
            webhook=request_body.webhook,
            execution_id=execution_id,
            write_back=write_back,
            first_stored=first_stored,
            confirm=confirm,
        )

    async def start(execution_id: str, write_back: WriteBack | None) -> Run:
        # The workflow as this process knows it saves a round trip before the first
        # event: the start's own round trip confirms it is still the stored one.
        known = svc.workflows.known(tenant_id, workflow_id)
        if known is not None:
            confirm = functools.partial(
                svc.workflows.confirm_in, tenant=tenant_id, workflow_id=workflow_id, stored=known
            )
            try:
                return await run(known.workflow, execution_id, write_back, confirm)
            except WorkflowChanged:
                pass  # replaced or deleted by another replica: nothing started; read it
        stored = await svc.workflows.get(tenant_id, workflow_id)
        return await run(stored.workflow, execution_id, write_back, None)

    return start


@router.post(
    "/{workflow_id}/execute",
    response_model=None,
    status_code=202,
    responses={
        200: {
            "content": SSE,
            "description": "The execution's SSE stream (Accept: text/event-stream)",
        },
        202: {"model": Started, "description": "Started"},
        **errors(400, 404, 413, 415, 422, 429, *API_ERRORS),
    },
    openapi_extra={
        "parameters": [IDEMPOTENCY_KEY],
        **json_example({"input": {"amount": 40, "customer": "Zed"}}),
    },
)
async def execute(
    workflow_id: str,
    request: Request,
    svc: ServicesDep,
    tenant_id: TenantDep,
    body: Annotated[ExecuteRequest | None, Body()] = None,
) -> Response:
    """Start an execution; stream it when the client accepts SSE, else answer 202."""
    request_body = body or ExecuteRequest()
    await check_large_input(request_body.input)
    streaming = "text/event-stream" in request.headers.get("accept", "")
    start = _starter(svc, tenant_id, workflow_id, request_body, first_stored=not streaming)
    if streaming:
        svc.streams.take(tenant_id)  # before starting: a refused stream starts nothing
    try:
        outcome = await svc.idempotency.execute(
            request, tenant=tenant_id, scope=workflow_id, action=start, found=svc.runner.found
        )
    except BaseException:
        if streaming:
            svc.streams.give_back(tenant_id)
        raise
    if outcome.status >= 400:
        if streaming:
            svc.streams.give_back(tenant_id)
        return JSON(outcome.body, status_code=outcome.status)
    execution_id = outcome.body["executionId"]
    if streaming:
        reader = None
        if outcome.body.get("status") == "queued":
            # Opened here, as a stream request's reader is: it reads the record, so its
            # place in line goes out first (SPEC §4 "Queued"), not only heartbeats.
            reader = svc.readers.reader(execution_id, cursor=0)
            try:
                await reader.open()
            except BaseException:
                svc.streams.give_back(tenant_id)
                raise
        return sse_response(
            svc, execution_id, cursor=0, tenant=tenant_id, slot_taken=True, reader=reader
        )
    answer = {
        **outcome.body,
        "streamUrl": f"/api/executions/{execution_id}/stream",
        "streamToken": svc.tokens.issue(execution_id),
    }
    return JSON(orjson.dumps(answer), status_code=202)
