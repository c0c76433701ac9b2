"""The contracts of the scripts that touch more than one key (append, claim, read,
start and quota.lua), run again on a real three-node Valkey Cluster.

Every case of those scripts' modules is collected here once more, as
``test_<script>_<case>``, with this module's ``redis`` (a cluster client) and
``node_url`` (the node that serves a key's slot, where its scripts publish). One module,
so the cluster starts once. Each case makes its own execution id, so the cases spread
over the three nodes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from tests.execution.scripts import test_append, test_claim, test_quota, test_read, test_start
from tests.support import ports
from tests.support.cluster import BUS_PORT_OFFSET, ValkeyCluster

MULTI_KEY = {
    "append": test_append,
    "claim": test_claim,
    "read": test_read,
    "start": test_start,
    "quota": test_quota,
}

for _script, _module in MULTI_KEY.items():
    for _name, _case in vars(_module).items():
        if _name.startswith("test_") and callable(_case):
            globals()[f"test_{_script}_{_name.removeprefix('test_')}"] = _case


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ValkeyCluster]:
    async with ValkeyCluster(data_dir=tmp_path_factory.mktemp("scripts-cluster")) as nodes:
        yield nodes


@pytest.fixture(scope="module")
async def cluster_client(cluster: ValkeyCluster) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(cluster.node_url(cluster.ports[0]))
    yield client
    await client.aclose()


@pytest.fixture
def redis(cluster_client: RedisCluster) -> Redis:
    # The cluster client speaks the same commands, as it does for EventBuffer.
    client: Any = cluster_client
    return client


@pytest.fixture
def node_url(cluster_client: RedisCluster) -> Callable[[str], str]:
    def url(key: str) -> str:
        node = cluster_client.get_node_from_key(key)
        assert node is not None, f"no node serves the slot of {key}"
        return f"redis://{node.host}:{node.port}"

    return url


@pytest.mark.timeout(60)
async def test_a_cluster_comes_up_where_the_ephemeral_range_leaves_no_pair_below_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/support/ports.py keeps a node's port and its bus port (10000 above) below
    the kernel's ephemeral range; where that range starts at 1024 (a common tuning) no
    pair fits below it, and every cluster failed to be made ("no free pair of loopback
    ports 10000 apart below 1024"). The pair then comes from the kernel's range, as the
    single ports do (``free_port``)."""
    low = tmp_path / "ip_local_port_range"
    low.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", low)
    monkeypatch.setattr(ports, "_ORDER", [])  # what the module computes with that range
    async with ValkeyCluster(data_dir=tmp_path / "cluster") as nodes:
        client = RedisCluster.from_url(nodes.node_url(nodes.ports[0]))
        try:
            await client.set("low-range", "1")
            assert await client.get("low-range") == b"1"
        finally:
            await client.aclose()
    assert all(port + BUS_PORT_OFFSET < 65_536 for port in nodes.ports), nodes.ports
