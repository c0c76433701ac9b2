"""Every error becomes ``{"error": {"code", "message"}}`` here, and nowhere else."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.responses import JSON
from lib.errors import (
    BufferUnavailable,
    Conflict,
    FlowcastError,
    InvalidInput,
    NotFound,
    OverQuota,
    PauseHeld,
    Problem,
    ShuttingDown,
    TooBusy,
    error_path,
)

log = logging.getLogger(__name__)


class ApiError(FlowcastError):
    """An error raised by the HTTP layer itself, with its status code."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSON:
    body = {"error": {"code": code, "message": message, **extra}}
    return JSON(body, status_code=status, headers=headers)


def status_of(exc: FlowcastError) -> int:
    """The HTTP status for one of our errors."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, Conflict):
        return 409
    if isinstance(exc, InvalidInput):
        return 422
    if isinstance(exc, BufferUnavailable | ShuttingDown):
        return 503
    if isinstance(exc, TooBusy):
        return 429
    return 500


def error_payload(exc: FlowcastError) -> tuple[int, dict[str, Any]]:
    """The status and body that answer one of our errors."""
    extra: dict[str, Any] = {}
    if isinstance(exc, InvalidInput) and exc.problems:
        extra["problems"] = [problem.as_dict() for problem in exc.problems]
    if isinstance(exc, Conflict) and exc.details:
        extra.update(exc.details)
    if isinstance(exc, OverQuota):
        extra.update(exc.details)
    return status_of(exc), {"error": {"code": exc.code, "message": exc.message, **extra}}


async def _flowcast_error(request: Request, exc: Exception) -> JSON:
    assert isinstance(exc, FlowcastError)
    status, body = error_payload(exc)
    if isinstance(exc, PauseHeld):
        # Not a failure: a hold after the store came back empty, said as such.
        log.warning("request held", extra={"path": request.url.path, "error": exc.message})
    elif status >= 500:
        log.error("request failed", extra={"path": request.url.path, "error": exc.message})
    headers = exc.headers if isinstance(exc, ApiError) else None
    if isinstance(exc, TooBusy | PauseHeld):
        headers = {"Retry-After": str(exc.retry_after)}
    return JSON(body, status_code=status, headers=headers)


class InvalidRequest(InvalidInput):
    """A request body that cannot be read as the route's: not JSON, or not its shape."""

    code = "invalid_request"


async def _validation_error(request: Request, exc: Exception) -> JSON:
    assert isinstance(exc, RequestValidationError)
    # The fields the route's body takes (app/requests.py JsonRoute), to say how to fix it.
    keys: tuple[str, ...] = getattr(request.scope.get("route"), "body_keys", ())
    problems = [_worded(error, keys) for error in exc.errors()]
    if len(problems) == 1:
        message = problems[0].message
    else:
        shown = "; ".join(problem.message for problem in problems[:3])
        message = f"the request has {len(problems)} problems: {shown}"
    return error_response(
        422, "invalid_request", message, problems=[problem.as_dict() for problem in problems]
    )


def _worded(error: Any, keys: tuple[str, ...]) -> Problem:
    """One of pydantic's errors in Flowcast's words: what to send instead."""
    loc = tuple(error.get("loc", ()))
    inside = loc[1:] if loc[:1] == ("body",) else tuple(part for part in loc if part != "body")
    path = "$" + error_path(inside)
    kind = error.get("type", "")
    shape = "{" + ", ".join(f'"{key}": …' for key in keys) + "}"
    wrap = '; wrap the input in {"input": …}' if "input" in keys else ""
    if keys and loc[:1] == ("body",):
        if not inside and kind == "missing":
            return Problem(path, f"a body is required: send {shape}")
        if not inside and kind in ("model_attributes_type", "model_type", "dict_type"):
            return Problem(path, f"the body must be a JSON object like {shape}{wrap}")
        if len(inside) == 1 and kind == "extra_forbidden":
            return Problem(path, f'unknown field "{inside[0]}": the body is {shape}{wrap}')
        if len(inside) == 1 and kind == "missing":
            return Problem(path, f'"{inside[0]}" is required: the body is {shape}')
    return Problem(path, str(error.get("msg", "invalid")))


async def _http_error(request: Request, exc: Exception) -> JSON:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
    code = codes.get(exc.status_code, "http_error")
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, code, str(exc.detail), headers=headers)


async def _unexpected(request: Request, exc: Exception) -> JSON:
    log.exception("unhandled error", extra={"path": request.url.path})
    return error_response(500, "internal_error", "the server failed to handle the request")


def install(app: FastAPI) -> None:
    """Register the exception handlers on the app."""
    app.add_exception_handler(FlowcastError, _flowcast_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
