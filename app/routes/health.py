"""Liveness, readiness and metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.responses import JSON
from app.schemas import Health, Readiness
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
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus metrics"}},
)
async def metrics(svc: Annotated[Services, Depends(services)]) -> Response:
    """Prometheus metrics of this process."""
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)
