"""The reconciler on a real three-node Valkey Cluster (SPEC §14 "A queued execution
survives every process dying ... It all works on Redis Cluster"): the node that holds
the lines (the ``{queue}`` hash tag) restarts empty while the records, in their own
slots on the other nodes, still say ``queued``; the worker notices another server
answers (store.py asks every primary) and puts them back in line, also those whose
tenant's unfinished index was lost with the lines (it looks at every record), and each
runs once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection

from app.connections import connect
from lib.errors import BufferUnavailable
from lib.execution.buffer import EventBuffer
from lib.execution.queue import Queue
from lib.execution.store import StoreIdentity
from tests.support.api import delay_workflow, put, quick_workflow, wait_finished, wait_status
from tests.support.cluster import ValkeyCluster
from tests.support.logcheck import check_log
from tests.support.servers import FlowcastServer, prefix


@pytest.mark.timeout(120)
async def test_queued_executions_survive_the_restart_of_the_node_of_the_lines(
    tmp_path: Path,
) -> None:
    async with ValkeyCluster(data_dir=tmp_path / "cluster") as cluster:
        named = prefix()
        env = {
            "FLOWCAST_REDIS_URL": cluster.url,
            "FLOWCAST_REDIS_PREFIX": named,
            "FLOWCAST_MAX_RUNNING_PER_TENANT": "1",
            "FLOWCAST_LEASE_SECONDS": "2",
        }
        api = FlowcastServer(data_dir=tmp_path / "api", env={**env, "FLOWCAST_WORKER_SLOTS": "0"})
        worker = FlowcastServer(data_dir=tmp_path / "worker", env=env)
        await api.start()
        await worker.start()
        try:
            async with httpx.AsyncClient(base_url=api.url, timeout=20) as client:
                await put(client, delay_workflow("slow", ms=2000))
                await put(client, quick_workflow("quick"))
                first = (await client.post("/api/workflows/slow/execute", json={})).json()
                await wait_status(client, first["executionId"], "running")
                queued = []
                for _ in range(6):
                    answered = await client.post("/api/workflows/quick/execute", json={})
                    assert answered.status_code == 202, answered.text
                    answer = answered.json()
                    assert answer["status"] == "queued", answer
                    queued.append(answer["executionId"])
                lines = await cluster.node_of(f"{named}:{{queue}}:tenants")
                # Only the executions whose records live on another node survive it.
                kept = [
                    eid
                    for eid in queued
                    if await cluster.node_of(f"{named}:{{{eid}}}:meta") != lines
                ]
                assert kept, "every record on the node of the lines: try again"
                # The workflow is lost with that node only if its stored definition went
                # too: then each kept execution ends failed (workflow_lost), never stuck.
                lost = await cluster.node_of(f"{named}:workflows:default") == lines
                survivors = kept
                if await cluster.node_of(f"{named}:{{{first['executionId']}}}:meta") != lines:
                    survivors = [first["executionId"], *kept]
                await cluster.restart_node(lines)
                for eid in survivors:
                    ended = await wait_finished(client, eid, timeout=12)
                    if lost and eid != first["executionId"]:
                        assert ended["status"] in ("completed", "failed"), ended
                        if ended["status"] == "failed":
                            assert ended["error"]["code"] == "workflow_lost", ended
                        continue
                    assert ended["status"] == "completed", ended
                    log = (await client.get(f"/api/executions/{eid}/events")).json()["events"]
                    check_log(log)
                    kinds = [e["type"] for e in log]
                    assert kinds.count("execution:started") == 1, kinds
        finally:
            await worker.stop()
            await api.stop()


@pytest.mark.timeout(60)
async def test_the_store_settles_whatever_node_each_process_calls_its_default(
    tmp_path: Path,
) -> None:
    """Two processes whose cluster clients chose other default nodes (a client picks its
    default again each time it reads the slots: after the restart of the node of the
    lines, in a CI run under load, the API's was the restarted node and the worker's
    another) tell store.lua the same primaries under another "run id". Each call was a
    change for the other one, so the settle that follows a restart never ended: the
    janitors never swept a lease again, and the first execution of the test above, whose
    run ended without storing its last event while its node was down, stayed running
    for good. The settle starts once, with the restart, and ends."""
    async with ValkeyCluster(data_dir=tmp_path / "cluster") as cluster:
        named = prefix()
        clients = [connect(cluster.url, socket_timeout=5, max_connections=4) for _ in range(2)]
        try:
            stores = []
            for client, port in zip(clients, cluster.ports, strict=False):
                assert isinstance(client, RedisCluster)
                await client.initialize()
                node = client.get_node(host="127.0.0.1", port=port)
                assert node is not None
                client.set_default_node(node)
                buffer = EventBuffer(redis=client, prefix=named)
                stores.append(StoreIdentity(buffer=buffer, lease_seconds=2))
            first = stores[0]
            # Both tell the store what answers (the second is a new process: no settle).
            for store in stores:
                assert (await store.check()).settling_seconds == 0
            await cluster.restart_node(cluster.ports[2])
            # The restart is a change for the first to notice; the second, noticing it
            # too, must not start the settle again, nor must any call after them.
            began = (await first.check()).settling_seconds
            assert 0 < began <= first.settle_seconds
            left = began
            for _ in range(6):
                for store in stores:
                    now = (await store.check()).settling_seconds
                    assert now <= left, (now, left)
                    left = now
            # And it ends: a claim waits it out instead of answering 503.
            for store in stores:
                assert (await store.wait_settled()).settling_seconds == 0
        finally:
            for client in clients:
                await client.aclose()


@pytest.mark.timeout(60)
async def test_a_connection_the_cluster_client_closes_under_a_take_is_an_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster client that gets CLUSTERDOWN (the restarted node of the lines serves
    its slots only about 2 s after it answers) closes every connection it holds, also
    one another command is connecting on: that command fails inside the client with an
    AttributeError ('NoneType' object has no attribute 'writelines'). In a CI run under
    load it ended the worker's dispatcher task, and the queued executions put back in
    line were never taken. It is an outage of the store like any other (the dispatcher
    logs it and takes again at its next round)."""
    send = AbstractConnection._send_packed_command
    closed: list[AbstractConnection] = []

    async def closed_under_it(self: AbstractConnection, command: Any) -> None:
        if not closed and self._writer is not None:
            # What the client's aclose(), in another task, does to this connection
            # while the command waits its turn to be written (disconnect()).
            closed.append(self)
            self._writer.close()
            self._writer = None
        await send(self, command)

    async with ValkeyCluster(data_dir=tmp_path / "cluster") as cluster:
        client = connect(cluster.url, socket_timeout=5, max_connections=4)
        try:
            assert isinstance(client, RedisCluster)
            queue = Queue(buffer=EventBuffer(redis=client, prefix=prefix()), lease_seconds=2)
            assert await queue.take("f1") is None  # connected, nothing queued
            await client.aclose()  # as on a CLUSTERDOWN: every connection is closed
            await client.initialize()  # the slots read again; the next command connects
            monkeypatch.setattr(AbstractConnection, "_send_packed_command", closed_under_it)
            with pytest.raises(BufferUnavailable):
                await queue.take("f2")
            assert closed, "the fault was never injected"
            assert await queue.take("f3") is None  # the next round takes again
        finally:
            await client.aclose()
