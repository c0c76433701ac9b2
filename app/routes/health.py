"""Liveness, readiness and metrics.

``/healthz`` and ``/readyz`` answer anyone: load balancers and container healthchecks
probe them without credentials, and they tell nothing but up or down. ``/metrics``
counts every tenant's work, so once API keys are set it needs one (any tenant's: the
figures carry no tenant, workflow or execution label), unless
``FLOWCAST_METRICS_PUBLIC`` opens it for a scraper that cannot send a Bearer token.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.auth import authenticate
from app.responses import JSON
from app.schemas import Health, Readiness, errors
from app.services import Services, services

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={200: {"model": Health}})
async def healthz() -> JSON:
    return JSON({"status": "ok"})


@router.get(
    "/readyz",
    responses={
        200: {"model": Readiness},
        503: {"model": Readiness, "description": "Not ready"},
    },
)
async def readyz(svc: Annotated[Services, Depends(services)]) -> JSON:
    checks = {
        "buffer": await svc.buffer.ping(),
        "values": await svc.values.ping(),
    }
    ready = all(checks.values())
    return JSON(
        {"status": "ready" if ready else "unavailable", "checks": checks},
        status_code=200 if ready else 503,
    )


@router.get(
    "/metrics",
    response_model=None,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus metrics"},
        **errors(401),
    },
)
async def metrics(request: Request, svc: Annotated[Services, Depends(services)]) -> Response:
    """Prometheus metrics of this process (an API key when keys are set, unless public)."""
    if not svc.settings.metrics_public:
        authenticate(request, svc.keys)
    await svc.metrics.refresh()  # the queue's figures live in Redis
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)
