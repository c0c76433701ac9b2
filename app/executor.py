"""The executor and what its blocks reach, opened in the lifespan: the HTTP clients, the
``llm`` providers with their cross-replica slots, tenants' secrets (and log masking with
them), and the template workers."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass

import httpx

from app import logs
from app.catalog import Catalog
from app.settings import Settings
from app.stores import Stores
from app.tokens import load_secret
from lib.workflows.blocks.base import BlockServices
from lib.workflows.executor import Executor
from lib.workflows.pool import TemplatePool
from lib.workflows.providers import Providers
from lib.workflows.secrets import SecretStore
from lib.workflows.slots import Slots


@dataclass(frozen=True)
class Blocks:
    """The executor and what its blocks reach: model providers and secrets."""

    executor: Executor
    providers: Providers
    secrets: SecretStore
    secret_key: bytes


async def open_executor(
    stack: AsyncExitStack, settings: Settings, stores: Stores, catalog: Catalog
) -> Blocks:
    """The executor with its HTTP clients, ``llm`` slots, secrets and template workers."""
    http = httpx.AsyncClient(
        follow_redirects=False,
        limits=httpx.Limits(max_connections=settings.http_max_concurrency),
    )
    stack.push_async_callback(http.aclose)
    # Model calls stream for long: a client of their own, so they never wait for
    # (or hold) the http blocks' connections.
    llm_http = httpx.AsyncClient(follow_redirects=False)
    stack.push_async_callback(llm_http.aclose)
    slots = Slots(
        redis=stores.redis,
        tail_redis=stores.tail_redis,
        prefix=settings.redis_prefix,
        lease_seconds=settings.lease_seconds,
    )
    stack.push_async_callback(slots.close)
    await slots.introduce(catalog.llm_providers)
    providers = Providers(catalog.llm_providers, http=llm_http, slots=slots)
    secret_key = load_secret(settings.secret_key, settings.data_dir)
    secrets = SecretStore(
        redis=stores.redis, key=secret_key, prefix=settings.redis_prefix, quota=stores.quota
    )
    logs.mask_with(secrets.redact_text)
    stack.callback(logs.mask_with, None)
    template_pool = await stack.enter_async_context(
        TemplatePool(
            size=settings.template_workers,
            timeout_ms=settings.template_timeout_ms,
            max_output_bytes=settings.template_max_bytes,
        )
    )
    executor = Executor(
        catalog.block_types,
        BlockServices(
            http=http,
            http_allow_private=settings.http_allow_private,
            http_limiter=asyncio.Semaphore(settings.http_max_concurrency),
            templates=template_pool,
            llm=providers,
        ),
        concurrency=settings.block_concurrency,
        secrets=secrets,
        memory_limit=settings.execution_memory_bytes,
    )
    return Blocks(executor=executor, providers=providers, secrets=secrets, secret_key=secret_key)
