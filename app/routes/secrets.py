"""``/api/secrets``: a tenant's secrets. Values go in and never come out."""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Body, Depends, Response
from pydantic import BaseModel, ConfigDict, Field

from app.requests import JsonRoute
from app.responses import JSON
from app.schemas import API_ERRORS, errors, json_example
from app.services import Services, services, tenant
from lib.workflows.secrets import check_name

router = APIRouter(prefix="/api/secrets", tags=["secrets"], route_class=JsonRoute)

ServicesDep = Annotated[Services, Depends(services)]
TenantDep = Annotated[str, Depends(tenant)]


class SecretBody(BaseModel):
    """Body of ``PUT /api/secrets/{name}``."""

    model_config = ConfigDict(extra="forbid")

    value: str = Field(description="write-only: no route ever returns it")


class SecretName(BaseModel):
    name: str
    updated_at: str = Field(alias="updatedAt")


class SecretList(BaseModel):
    secrets: list[SecretName]


@router.get("", responses={200: {"model": SecretList}, **errors(*API_ERRORS)})
async def list_secrets(svc: ServicesDep, tenant_id: TenantDep) -> JSON:
    """The tenant's secret names (never their values)."""
    found = await svc.secrets.list(tenant_id)
    return JSON(orjson.dumps({"secrets": [info.as_dict() for info in found]}))


@router.put(
    "/{name}",
    responses={
        200: {"model": SecretName, "description": "Replaced"},
        201: {"model": SecretName, "description": "Created"},
        **errors(413, 415, 422, 429, *API_ERRORS),
    },
    openapi_extra=json_example({"value": "sk-live-…"}),
)
async def put_secret(
    name: str, body: Annotated[SecretBody, Body()], svc: ServicesDep, tenant_id: TenantDep
) -> JSON:
    """Store a secret for ``{{ secrets.NAME }}`` in this tenant's http and llm blocks."""
    check_name(name)
    info, created = await svc.secrets.put(tenant_id, name, body.value)
    return JSON(orjson.dumps(info.as_dict()), status_code=201 if created else 200)


@router.delete("/{name}", status_code=204, responses=errors(404, *API_ERRORS))
async def delete_secret(name: str, svc: ServicesDep, tenant_id: TenantDep) -> Response:
    await svc.secrets.delete(tenant_id, name)
    return Response(status_code=204)
