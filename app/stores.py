"""Where executions live, opened first in the lifespan: the embedded engine (without
FLOWCAST_REDIS_URL), the Redis clients, the event buffer, and the value store with its
sweeper; and this process's node, whose lock proves earlier holders dead."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass

from redis.asyncio import Redis

from app.connections import connect
from app.embedded import EmbeddedValkey
from app.node import Node, claim_node
from app.settings import Settings, data_dir_in_use
from lib.execution.buffer import EventBuffer
from lib.execution.retention import Sweeper
from lib.execution.values import LocalValueStore, ValueStore
from lib.quota import StorageQuota

log = logging.getLogger("flowcast")

TAIL_BLOCK_MS = 5_000
# Blocking reads only: the readers' notify subscription, the control streams, and a
# provider's freed-slot reader while a call waits.
MAX_TAIL_CONNECTIONS = 64


@dataclass(frozen=True)
class Stores:
    """Where executions live: Redis (two pools), the event buffer, the value store."""

    redis: Redis
    tail_redis: Redis
    buffer: EventBuffer
    values: ValueStore
    node: Node  # this process's node, and the earlier ones it proved dead
    quota: StorageQuota  # each tenant's share of the Redis (FLOWCAST_TENANT_STORAGE_BYTES)


async def open_stores(stack: AsyncExitStack, settings: Settings) -> Stores:
    """The embedded engine (without FLOWCAST_REDIS_URL), the Redis clients, the buffer,
    and the value store with its sweeper."""
    if data_dir_in_use(settings):
        log.info(
            "data directory (FLOWCAST_DATA_DIR)",
            extra={"dir": str(settings.data_dir.resolve())},
        )
    # Held until the process exits: the proof, for the next process on this data
    # directory, that this one is dead (its runs are then taken over at once).
    node = claim_node(settings.data_dir)
    stack.callback(node.close)
    redis_url = settings.redis_url
    if redis_url is None:
        if not node.held:
            # Two engines on one AOF would be two stores of the same executions, whose
            # owners never fence each other: refuse, rather than run each run twice.
            message = (
                "another Flowcast process runs the embedded engine in this data directory "
                "(FLOWCAST_DATA_DIR): give this one a data directory of its own, or point "
                "every process at one Redis with FLOWCAST_REDIS_URL"
            )
            log.error(message, extra={"dir": str(settings.data_dir.resolve())})
            raise RuntimeError(message)
        engine = EmbeddedValkey(data_dir=settings.data_dir / "valkey")
        await stack.enter_async_context(engine)
        redis_url = engine.url
    redis = connect(
        redis_url,
        socket_timeout=TAIL_BLOCK_MS / 1000 + 10,
        max_connections=settings.redis_max_connections,
    )
    stack.push_async_callback(redis.aclose)
    # Blocking reads hold their connection: a pool of their own, so they never
    # starve the requests of connections.
    tail_redis = connect(
        redis_url,
        socket_timeout=TAIL_BLOCK_MS / 1000 + 10,
        max_connections=MAX_TAIL_CONNECTIONS,
        queue=False,
    )
    stack.push_async_callback(tail_redis.aclose)
    quota = StorageQuota(
        redis=redis, limit_bytes=settings.tenant_storage_bytes, prefix=settings.redis_prefix
    )
    buffer = EventBuffer(
        quota=quota,
        redis=redis,
        tail_redis=tail_redis,
        prefix=settings.redis_prefix,
        event_limit=settings.event_limit,
        budget_bytes=settings.event_budget_bytes,
        retention_seconds=settings.retention_seconds,
    )
    values = _value_store(settings)
    await stack.enter_async_context(
        Sweeper(store=values, buffer=buffer, interval_seconds=settings.sweep_seconds)
    )
    return Stores(
        redis=redis, tail_redis=tail_redis, buffer=buffer, values=values, node=node, quota=quota
    )


def _value_store(settings: Settings) -> ValueStore:
    """S3 when a bucket is configured, else a directory under the data directory."""
    if settings.s3_bucket:
        from lib.execution.s3 import S3ValueStore  # boto3 is imported only when used

        return S3ValueStore(
            bucket=settings.s3_bucket,
            prefix=settings.s3_prefix,
            endpoint_url=settings.s3_endpoint_url,
        )
    root = settings.data_dir / "values"
    root.mkdir(parents=True, exist_ok=True)
    return LocalValueStore(root=root)
