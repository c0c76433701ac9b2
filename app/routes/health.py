"""Liveness and readiness."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from app.responses import JSON
from app.services import Services, services

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> JSON:
    return JSON({"status": "ok"})


@router.get("/readyz")
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
