"""The Redis client for a URL: a single server, or a cluster.

``redis://`` and ``rediss://`` name one server; ``redis+cluster://`` and
``rediss+cluster://`` name any node of a Redis Cluster, whose slots the client then
discovers. Every key of one execution shares a hash tag, so the scripts run on a
cluster unchanged.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def connect(url: str, *, socket_timeout: float, max_connections: int, queue: bool = True) -> Redis:
    """A client for ``url``; cluster URLs get a cluster client with the same interface.

    The pool holds at most ``max_connections`` (per node on a cluster). With ``queue``,
    a call that finds them all busy waits its turn for one, however long, instead of
    failing: a Redis call never fails because the pool was busy (step 16's review: a
    storm of 5,000 opens answered 79 of them 503 after a 10 s wait). Every connection
    comes back within ``socket_timeout``, so the wait ends.
    """
    scheme, sep, rest = url.partition("://")
    options: dict[str, Any] = {
        "socket_connect_timeout": 5,
        "socket_timeout": socket_timeout,
    }
    # After a Redis restart every pooled connection is dead: a command on one is sent
    # again on a fresh connection instead of failing the request. Only a refused or
    # closed connection is retried, never a timeout; every script tolerates a second
    # run (append.lua finds its own batch, claims answer with the state that won).
    retry: dict[str, Any] = {
        "retry": Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=2),
        "retry_on_error": [ConnectionError],
    }
    if scheme in CLUSTER_SCHEMES:
        cluster: Any = RedisCluster.from_url(
            f"{CLUSTER_SCHEMES[scheme]}{sep}{rest}", max_connections=max_connections, **options
        )
        # The cluster client speaks the same commands; the buffer only uses those.
        client: Redis = cluster
        return client
    if not queue:
        return Redis.from_url(
            url, health_check_interval=30, max_connections=max_connections, **options, **retry
        )
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        health_check_interval=30,
        **options,
        **retry,
    )
    return Redis(connection_pool=pool)
