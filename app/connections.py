"""The Redis client for a URL: a single server, or a cluster.

``redis://`` and ``rediss://`` name one server; ``redis+cluster://`` and
``rediss+cluster://`` name any node of a Redis Cluster, whose slots the client then
discovers. Every key of one execution shares a hash tag, so the scripts run on a
cluster unchanged.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def connect(url: str, *, socket_timeout: float) -> Redis:
    """A client for ``url``; cluster URLs get a cluster client with the same interface."""
    scheme, sep, rest = url.partition("://")
    options: dict[str, Any] = {
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
    }
    if scheme in CLUSTER_SCHEMES:
        cluster: Any = RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}{sep}{rest}", **options)
        # The cluster client speaks the same commands; the buffer only uses those.
        client: Redis = cluster
        return client
    return Redis.from_url(url, health_check_interval=30, **options)
