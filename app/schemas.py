"""The API's bodies as the OpenAPI schema documents them.

The routes answer with ``JSON`` responses they build themselves (orjson), so these
models only describe: they are named in the route decorators (``responses=``,
``openapi_extra=``) and never serialize anything. The fuzz test holds every response
to them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from lib.workflows.model import Workflow

Status = Literal["queued", "running", "paused", "completed", "failed", "cancelled"]

_DESCRIPTIONS = {
    400: "A parameter or the body could not be read",
    401: (
        "An API key (or, on stream, value and live list routes, a token) is missing or not valid"
    ),
    404: "No such workflow, execution or value (for this caller)",
    409: "The target is not in a state that allows this",
    413: "The request body is larger than FLOWCAST_MAX_BODY_BYTES",
    415: "The body is not sent as Content-Type: application/json",
    422: "The request is well-formed but not valid",
    429: "The tenant already runs as many executions, or keeps as many bytes, as it may",
    503: "The event buffer or the value store cannot be reached, or the server is stopping",
}


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class ErrorDetail(BaseModel):
    """What went wrong; some errors add fields (``problems``, ``status``, …)."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer: ``{"error": {"code", "message", …}}``."""

    error: ErrorDetail


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses, all with the error body."""
    return {code: {"model": ErrorBody, "description": _DESCRIPTIONS[code]} for code in codes}


# Every /api route: a missing or unknown key, or the buffer out of reach.
API_ERRORS = (401, 503)


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "unavailable"]
    checks: dict[str, bool]


class WorkflowSummary(BaseModel):
    id: str
    name: str
    description: str
    blocks: int
    source: Literal["api", "file"]


class WorkflowList(BaseModel):
    workflows: list[WorkflowSummary]


class WorkflowDocument(BaseModel):
    """A workflow as stored; reading one adds where it came from."""

    model_config = ConfigDict(extra="allow")

    id: str
    name: str
    description: str
    blocks: list[dict[str, Any]]
    edges: list[dict[str, Any]]
    input_schema: dict[str, Any] | None = Field(
        None,
        alias="inputSchema",
        description="A JSON Schema an execution's input must match (else 422 at execute)",
    )
    example_input: Any = Field(
        None, alias="exampleInput", description="An input to start with; matches inputSchema"
    )
    source: Literal["api", "file"] | None = None


class Snapshot(_Camel):
    """An execution's metadata; ``output``, ``error`` and ``pause`` only when set."""

    id: str
    workflow_id: str
    status: Status
    created_at: str
    updated_at: str
    last_event_id: int
    first_retained_event_id: int
    output: Any = None
    error: Any = None
    pause: Any = None
    ahead: int | None = None  # queued: about how many executions start before it
    # "rejected" once a person answered an approval with approved false (the run may
    # still complete: the workflow decides what a rejection leads to).
    decision: Literal["rejected"] | None = None
    # With API keys: a token for this execution's stream (?token=), for an EventSource.
    stream_token: str | None = None


class ExecutionList(_Camel):
    """A page of the list, newest first; ``nextBefore`` asks for the page after it
    (``?before=``), null when this page is the last."""

    executions: list[Snapshot]
    next_before: str | None


class LiveToken(_Camel):
    """Open the live list at ``streamUrl`` with ``?token=streamToken`` (EventSource)."""

    stream_url: str
    stream_token: str


class Event(_Camel):
    """One stored event envelope."""

    model_config = ConfigDict(extra="allow")

    id: int
    type: str
    execution_id: str
    workflow_id: str
    ts: str
    data: Any = None


class EventPage(_Camel):
    events: list[Event]
    next_after: int
    first_retained_event_id: int
    last_event_id: int
    status: Status


class Accepted(_Camel):
    """A resume or cancel was accepted; ``status`` is where the execution is headed."""

    execution_id: str
    status: str


class Started(Accepted):
    """An execution was started (``status`` ``running``) or queued (``queued``, with
    ``ahead``); follow it at ``streamUrl`` with ``?token=streamToken``."""

    ahead: int | None = None

    stream_url: str
    stream_token: str


# Before OpenAPI 3.2 (no ``itemSchema``), an event stream's ``schema`` describes one event.
SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "id": {"type": "string", "pattern": "^[0-9]+$"},
        "data": {"type": "string", "contentMediaType": "application/json"},
        "retry": {"type": "integer"},
    },
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}


def workflow_body() -> dict[str, Any]:
    """``openapi_extra`` for ``PUT /api/workflows/{id}``: its body is a workflow.

    The route reads the body as any JSON (so every problem comes back as one 422 from
    the validator); the schema still tells clients, and the fuzzer, what is expected.
    """
    schema = _inlined(Workflow.model_json_schema(by_alias=True))
    # A body without an id takes the one in the URL.
    schema["required"] = [name for name in schema.get("required", []) if name != "id"]
    return {"requestBody": {"content": {"application/json": {"schema": schema}}}}


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its ``$defs`` spliced in: in the OpenAPI document, ``#`` is the
    document's root, so the model's own ``#/$defs/…`` references would not resolve."""
    definitions = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(definitions[ref.removeprefix("#/$defs/")])
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    result: dict[str, Any] = walk(schema)
    return result


def json_example(value: Any) -> dict[str, Any]:
    """``openapi_extra`` giving a JSON request body an example (the fuzzer sends it too)."""
    return {"requestBody": {"content": {"application/json": {"example": value}}}}


def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """An OpenAPI query parameter the route reads from ``request.query_params``."""
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}  # fmt: skip


def header(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """An OpenAPI header parameter the route reads from ``request.headers``."""
    return {"name": name, "in": "header", "required": False, "schema": schema,
            "description": description}  # fmt: skip


IDEMPOTENCY_KEY = header(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": 255},
    "A repeat with the same key and body gets the first outcome",
)
STREAM_TOKEN = query(
    "token",
    {"type": "string"},
    "A streamToken for this execution, instead of an API key (EventSource cannot send headers)",
)
