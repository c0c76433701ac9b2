"""``/api/webhooks``: the tenant's webhook signing secret (SPEC §15)."""

from __future__ import annotations

import datetime
from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from app.requests import JsonRoute
from app.responses import JSON
from app.schemas import API_ERRORS, errors
from app.services import Services, services, tenant
from lib.webhooks.signing import TenantSecrets

router = APIRouter(prefix="/api/webhooks", tags=["webhooks"], route_class=JsonRoute)

ServicesDep = Annotated[Services, Depends(services)]
TenantDep = Annotated[str, Depends(tenant)]


class WebhookSecret(BaseModel):
    secret: str = Field(description="whsec_…: verify deliveries with it (Standard Webhooks)")
    previous: str | None = Field(None, description="the secret before a rotation, while it signs")
    previous_until: str | None = Field(None, alias="previousUntil")


def _shown(found: TenantSecrets) -> JSON:
    signing = found.signing()
    until = None
    if len(signing) > 1 and found.previous_until is not None:
        moment = datetime.datetime.fromtimestamp(found.previous_until, datetime.UTC)
        until = moment.isoformat(timespec="seconds").replace("+00:00", "Z")
    return JSON(
        {
            "secret": found.current,
            "previous": signing[1] if len(signing) > 1 else None,
            "previousUntil": until,
        }
    )


@router.get("/secret", responses={200: {"model": WebhookSecret}, **errors(*API_ERRORS)})
async def get_secret(svc: ServicesDep, tenant_id: TenantDep) -> JSON:
    """The secret that signs this tenant's deliveries (made on first use)."""
    return _shown(await svc.webhook_secrets.get(tenant_id))


@router.post("/secret/rotate", responses={200: {"model": WebhookSecret}, **errors(*API_ERRORS)})
async def rotate_secret(svc: ServicesDep, tenant_id: TenantDep) -> JSON:
    """A new secret; the previous one goes on signing too for 24 hours."""
    return _shown(await svc.webhook_secrets.rotate(tenant_id))
