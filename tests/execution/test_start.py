"""The start transition as the runner asks it (``Ownership.start``): the admission, the
lease entry, the listing and the workflow version go in one round trip before
start.lua, which reserves the first id (step 15, the event path's latency: a first
frame waited for five round trips one after another)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from lib.backend import Batch, Keys
from lib.errors import BufferUnavailable, TooBusy
from lib.execution.admission import Admission
from lib.execution.buffer import EventBuffer
from lib.execution.indexes import creation_keys
from lib.execution.ownership import START_RESERVED, Ownership
from lib.execution.watchlists import lease_member
from tests.support.cluster import ValkeyCluster
from tests.support.ownership import ownership_parts
from tests.support.servers import ValkeyServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def buffer(redis: Redis) -> EventBuffer:
    return EventBuffer(redis=redis, prefix=f"t{uuid.uuid4().hex[:6]}")


async def start(ownership: Ownership, fence: str, **options: Any) -> str | None:
    execution_id = f"ex_{uuid.uuid4().hex}"
    claim = await ownership.start(
        execution_id,
        fence=fence,
        workflow_id="wf",
        tenant="t",
        created_at="2026-01-01T00:00:00.000Z",
        created_ms=1,
        **options,
    )
    return execution_id if claim is not None else None


async def test_a_start_is_admitted_watched_listed_and_reserves_its_first_id(
    buffer: EventBuffer, redis: Redis
) -> None:
    ownership = ownership_parts(buffer, 15).ownership
    stored: list[object] = []
    execution_id = await start(
        ownership,
        "node-a:1",
        alongside=lambda batch: batch.call("SET", f"{buffer.prefix}:x", "v", then=stored.append),
    )
    assert execution_id is not None
    keys = buffer.keys
    assert await redis.zscore(keys.running("t"), "node-a:1") is not None
    assert await redis.zscore(keys.leases, lease_member(execution_id, "node-a:1")) is not None
    assert await redis.zscore(keys.index("t"), execution_id) == 1
    assert stored == [True] and await redis.get(f"{buffer.prefix}:x") == b"v"
    meta = await redis.hmget(keys.meta(execution_id), "reserved", "lastId")
    assert meta == [str(START_RESERVED).encode(), b"0"]


async def test_a_start_refused_by_its_tenants_cap_takes_its_lease_entry_back(
    buffer: EventBuffer, redis: Redis
) -> None:
    parts = ownership_parts(buffer, 15)
    capped = Admission(buffer=buffer, lease_seconds=15, limit=1)
    ownership = Ownership(
        buffer=buffer,
        lease_seconds=15,
        watch=parts.watch,
        admission=capped,
        control=parts.control,
    )
    assert await start(ownership, "node-a:1") is not None
    with pytest.raises(TooBusy):
        await start(ownership, "node-a:2")
    assert await redis.zrange(buffer.keys.running("t"), 0, -1) == [b"node-a:1"]
    leases = await redis.zrange(buffer.keys.leases, 0, -1)
    assert len(leases) == 1 and leases[0].endswith(b"node-a:1")


async def test_a_batch_loads_the_scripts_a_restarted_store_forgot(
    buffer: EventBuffer, redis: Redis
) -> None:
    ownership = ownership_parts(buffer, 15).ownership
    await redis.script_flush()
    assert await start(ownership, "node-a:1") is not None
    # A batch whose command the server refuses raises it, as BufferUnavailable.
    batch = Batch(redis)
    batch.call("INCR", f"{buffer.prefix}:not-a-number-{uuid.uuid4().hex}")
    batch.call("HSET", buffer.keys.index("t"), "a", "b")  # a sorted set: WRONGTYPE
    with pytest.raises(BufferUnavailable):
        await batch.send()


def capped_ownership(buffer: EventBuffer, limit: int) -> Ownership:
    parts = ownership_parts(buffer, 15)
    return Ownership(
        buffer=buffer,
        lease_seconds=15,
        watch=parts.watch,
        admission=Admission(buffer=buffer, lease_seconds=15, limit=limit),
        control=parts.control,
    )


async def test_a_start_refused_by_its_tenants_cap_leaves_no_listing(
    buffer: EventBuffer, redis: Redis
) -> None:
    """The step 15 second fault review: a 429 changes nothing, yet each refused start
    left its id in the tenant's index (only a list read past the grace pruned it), so a
    tenant hammering its cap piled up entries a list read scans before its executions."""
    ownership = capped_ownership(buffer, 1)
    running = await start(ownership, "node-a:1")
    assert running is not None
    for n in range(5):
        with pytest.raises(TooBusy):
            await start(ownership, f"node-a:{n + 2}")
    assert await redis.zrange(buffer.keys.index("t"), 0, -1) == [running.encode()]


async def test_a_start_whose_check_refuses_is_taken_back_before_its_admission_is_judged(
    buffer: EventBuffer, redis: Redis
) -> None:
    """A check queued with the start (the workflow the caller went on with, still the
    stored one) that refuses stops the start as a refusal does: nothing created, nothing
    admitted, watched or listed; judged before the admission (a tenant at its cap whose
    workflow changed is told about the workflow, as a start that read it first was)."""
    ownership = capped_ownership(buffer, 1)
    assert await start(ownership, "node-a:1") is not None  # the tenant is at its cap

    class Changed(Exception):
        pass

    def refused(reply: object) -> None:
        raise Changed

    before = await redis.zrange(buffer.keys.index("t"), 0, -1)
    with pytest.raises(Changed):
        await start(
            ownership,
            "node-a:2",
            checked=lambda batch: batch.call("GET", f"{buffer.prefix}:x", then=refused),
        )
    assert await redis.zrange(buffer.keys.index("t"), 0, -1) == before
    running = await redis.zrange(buffer.keys.running("t"), 0, -1)
    assert b"node-a:2" not in running
    leases = await redis.zrange(buffer.keys.leases, 0, -1)
    assert not [lease for lease in leases if lease.endswith(b"node-a:2")]


async def test_a_refused_start_of_a_named_id_keeps_the_listing_of_its_creator(
    buffer: EventBuffer, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step 15 second fault review: two requests start one named id (an
    Idempotency-Key's repeats); the one refused by the cap listed it first, and takes
    its listing back after the other created it: the execution stays listed."""
    refused_side = capped_ownership(buffer, 1)
    admitted_side = capped_ownership(buffer, 0)
    execution_id = f"ex_{uuid.uuid4().hex}"
    options: dict[str, Any] = {
        "workflow_id": "wf",
        "tenant": "t",
        "created_at": "2026-01-01T00:00:00.000Z",
        "created_ms": 1,
    }
    # Hold the refused side's batch answer until the other side created the execution.
    await redis.zadd(buffer.keys.running("t"), {"node-z:9": 10**15})
    original = Batch.send
    created = False

    async def send_then_let_the_other_create(batch: Batch) -> None:
        nonlocal created
        try:
            await original(batch)
        finally:
            if not created:
                created = True
                claim = await admitted_side.start(execution_id, fence="node-b:1", **options)
                assert claim is not None

    monkeypatch.setattr(Batch, "send", send_then_let_the_other_create)
    with pytest.raises(TooBusy):
        await refused_side.start(execution_id, fence="node-a:1", **options)
    assert await redis.exists(buffer.keys.meta(execution_id))
    assert await redis.zscore(buffer.keys.index("t"), execution_id) is not None


async def test_a_start_cut_off_by_a_redis_restart_leaves_no_admission(
    own_valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step 15 second fault review: Valkey killed between the start's batch (the
    admission taken) and start.lua, then back at once from its AOF: the start fails
    (503), nothing was created, and the tenant at a cap of 1 must have its room back
    (the admission taken back, not left to count for ten leases). The start's own undo
    runs while Redis is away: the janitor's next pass takes it back (``take_back_owed``,
    asked by the runner at each pass)."""
    redis = Redis.from_url(own_valkey.url, socket_connect_timeout=0.2)
    buffer = EventBuffer(redis=redis, prefix=f"t{uuid.uuid4().hex[:6]}")
    ownership = capped_ownership(buffer, 1)
    original = EventBuffer.create

    async def killed_first(self: EventBuffer, *args: Any, **kwargs: Any) -> bool:
        own_valkey.kill()
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(EventBuffer, "create", killed_first)
    try:
        with pytest.raises(BufferUnavailable):
            await start(ownership, "node-a:1")
        # Back from its AOF, having lost nothing, once the start answered its error.
        await own_valkey.start()
        monkeypatch.setattr(EventBuffer, "create", original)
        with pytest.raises(TooBusy):
            await start(ownership, "node-a:2")  # owed, not taken back yet
        # As the janitor passes do: each asks again until Redis answers it.
        async with asyncio.timeout(10):
            while await redis.zrange(buffer.keys.running("t"), 0, -1) != []:
                await ownership.take_back_owed()
        assert await start(ownership, "node-a:2") is not None
    finally:
        await redis.aclose()


async def test_a_start_that_cannot_run_here_is_queued_without_a_lease_entry(
    own_valkey: ValkeyServer,
) -> None:
    """A replica without a free slot (``here=False``: an API replica with no workers)
    has every start queued, owned by nobody: no lease entry is written, so none is taken
    back a round trip later (issue 25). One that may run here is watched as before."""
    redis = Redis.from_url(own_valkey.url)
    buffer = EventBuffer(redis=redis, prefix=f"t{uuid.uuid4().hex[:6]}")
    ownership = ownership_parts(buffer, 15).ownership

    async def sent(command: str) -> int:
        entry = (await redis.info("commandstats")).get(f"cmdstat_{command}")
        return int(entry["calls"]) if entry else 0

    try:
        running = await start(ownership, "node-a:2")  # the scripts loaded meanwhile
        assert running is not None
        leases = await redis.zrange(buffer.keys.leases, 0, -1)
        assert leases == [lease_member(running, "node-a:2").encode()]
        execution_id = f"ex_{uuid.uuid4().hex}"
        scripts, zrems = await sent("evalsha"), await sent("zrem")
        entered = await ownership.start(
            execution_id,
            fence="node-a:1",
            workflow_id="wf",
            tenant="t",
            created_at="2026-01-01T00:00:00.000Z",
            created_ms=1,
            here=False,
        )
        assert entered is not None and getattr(entered, "queued", False)
        # queue.lua's enter and start.lua only: no watch.lua add, no ZREM after it.
        assert (await sent("evalsha"), await sent("zrem")) == (scripts + 2, zrems)
        assert await redis.zrange(buffer.keys.leases, 0, -1) == leases
        assert await redis.zscore(buffer.keys.queued("t"), execution_id) is not None
        assert await redis.hget(buffer.keys.meta(execution_id), "status") == b"queued"
    finally:
        await redis.aclose()


async def test_a_queued_start_announces_itself_with_its_creation(
    own_valkey: ValkeyServer,
) -> None:
    """Issue 25: the queue's wake-up of a queued start goes in its creation's round trip
    (start.lua, then the XADD), not a round trip after it; a start that runs here
    announces nothing, and an announcement that fails fails no start (best effort)."""
    redis = Redis.from_url(own_valkey.url)
    buffer = EventBuffer(redis=redis, prefix=f"t{uuid.uuid4().hex[:6]}")
    transitions = ownership_parts(buffer, 15)
    ownership, control = transitions.ownership, transitions.control
    wake = buffer.keys.queue_wake
    try:
        running = await start(ownership, "node-a:1", announce=control.announce_queued_in)
        assert running is not None
        assert await redis.xlen(wake) == 0
        queued = await start(ownership, "node-a:2", here=False, announce=control.announce_queued_in)
        assert queued is not None
        assert await redis.hget(buffer.keys.meta(queued), "status") == b"queued"
        assert [fields for _, fields in await redis.xrange(wake)] == [{b"queued": b"1"}]
        # The stream's key holding something else: the XADD is refused, the start is not.
        await redis.delete(wake)
        await redis.set(wake, "not a stream")
        refused = await start(
            ownership, "node-a:3", here=False, announce=control.announce_queued_in
        )
        assert refused is not None
        assert await redis.hget(buffer.keys.meta(refused), "status") == b"queued"
        assert await redis.zscore(buffer.keys.queued("t"), refused) is not None
    finally:
        await redis.aclose()


@pytest.mark.timeout(90)
async def test_a_queued_start_on_a_cluster_is_not_failed_by_its_wake_ups_node(
    tmp_path: Path,
) -> None:
    """On a cluster the wake-up (XADD, ``{control}``) may live on another node than the
    creation (start.lua, the execution's slot): with that node down, the start is
    created and answered all the same. In one pipeline, the cluster client failed it
    whole (BufferUnavailable: a 503, its storage figure taken back) though the record
    was written and it would run."""
    async with ValkeyCluster(data_dir=tmp_path / "cluster") as cluster:
        # Their hash tags, not the prefix, place the wake-ups and the lines.
        wake_slot = key_slot(Keys("p").queue_wake.encode())
        lines = await cluster.node_of(Keys("p").queued("t"))
        # The wake-ups on a node of their own (a cluster of four or more primaries has
        # them apart from the lines), the one that goes down. Not the node of slot 0:
        # the client's default node, without which it can set itself up again no more.
        first = await cluster.server_of(0)
        down = next(port for port in cluster.ports if port not in (lines, first))
        await cluster.move_slot(wake_slot, down)
        client = RedisCluster.from_url(cluster.node_url(lines))
        try:
            await client.initialize()

            def on(key: str) -> int:
                node = client.get_node_from_key(key)
                assert node is not None
                return int(node.port)

            # A prefix, a tenant and an id whose other keys are on the nodes that stay up.
            for _ in range(1000):
                buffer = EventBuffer(redis=client, prefix=f"t{uuid.uuid4().hex[:6]}")
                tenant, ids = f"t{uuid.uuid4().hex[:6]}", [f"ex_{uuid.uuid4().hex}" for _ in "abc"]
                keys = buffer.keys
                touched = [*creation_keys(keys, tenant, "wf"), *map(keys.meta, ids)]
                if all(on(key) != down for key in touched):
                    break
            assert all(on(key) != down for key in touched)
            assert on(buffer.keys.queue_wake) == down
            transitions = ownership_parts(buffer, 15)
            announce = transitions.control.announce_queued_in
            # Every node knows the scripts before one goes down (SCRIPT LOAD goes to all).
            assert await start(transitions.ownership, "node-a:0", here=False, announce=announce)
            await cluster.kill_node(down)
            # The first on the connection the node had (written, its reply lost), the
            # next on a new one (refused).
            for number, execution_id in enumerate(ids):
                entered = await transitions.ownership.start(
                    execution_id,
                    fence=f"node-a:{number + 1}",
                    workflow_id="wf",
                    tenant=tenant,
                    created_at="2026-01-01T00:00:00.000Z",
                    created_ms=1,
                    here=False,
                    announce=announce,
                )
                assert entered is not None and getattr(entered, "queued", False), entered
                assert await client.hget(keys.meta(execution_id), "status") == b"queued"
                assert await client.zscore(keys.queued(tenant), execution_id) is not None
        finally:
            await client.aclose()
