"""``GET /api/executions/live``: the list, then a frame per status change, from any
replica; its filters, its auth (API key or list token), its cap, its heartbeats, a pub/sub
reconnect and a shutdown."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app.auth import tenant_of_key
from app.tokens import ListGrant, StreamTokens
from tests.support.api import (
    execute,
    put,
    quick_workflow,
    sse_clients,
    start_execution,
    until,
    wait_finished,
)
from tests.support.live_list import FRAME_SECONDS, LIVE, live
from tests.support.servers import (
    FlowcastServer,
    ValkeyServer,
    authed,
    bearer,
    flowcast_on,
    serving,
    serving_pair,
)
from tests.support.sse import Frame, collect, frames

ALICE, BOB = "alice-key-" + "l" * 20, "bob-key-" + "m" * 20
CAROL = "carol-key-" + "n" * 20  # only the stream cap test opens streams as Carol


def approval_workflow(workflow_id: str) -> dict[str, Any]:
    """review (an approval) → done: a run that waits for a resume."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "review", "type": "approval", "config": {"prompt": "ok?", "schema": {}}},
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.review.output }}"}},
        ],
        "edges": [{"from": "review", "to": "done"}],
    }


# ---------------------------------------------------------------- one server


async def test_the_list_comes_first_then_each_status_change_as_it_happens(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"live-{unique}"
    await put(client, approval_workflow(workflow_id))
    earlier = await execute(client, workflow_id, {})
    async with live(client, f"workflowId={workflow_id}") as stream:
        (row,) = await stream.rows()
        assert row["id"] == earlier and row["workflowId"] == workflow_id
        assert set(row) == {
            "id",
            "workflowId",
            "status",
            "createdAt",
            "updatedAt",
            "lastEventId",
        }
        if row["status"] == "running":
            assert await stream.until(earlier, "paused") == ["paused"]

        execution_id = await execute(client, workflow_id, {})
        started = await stream.until(execution_id, "running")
        assert started == ["running"]
        # Started and paused may be stored in one batch: "paused" is what it shows then.
        assert await stream.until(execution_id, "paused") == ["paused"]

        resumed = await client.post(f"/api/executions/{execution_id}/resume", json={"input": 1})
        assert resumed.status_code == 202, resumed.text
        seen = await stream.until(execution_id, "completed")
        assert seen in (["running", "completed"], ["completed"]), seen
        snapshot = await wait_finished(client, execution_id)
        for name in ("createdAt", "updatedAt", "lastEventId"):
            assert stream.row[name] == snapshot[name], name

    # A new stream's list has both, newest first, as GET /api/executions has them.
    async with live(client, f"workflowId={workflow_id}") as stream:
        rows = await stream.rows()
    listed = (await client.get(f"/api/executions?workflowId={workflow_id}")).json()
    assert [(r["id"], r["status"]) for r in rows] == [
        (r["id"], r["status"]) for r in listed["executions"]
    ]
    assert [r["id"] for r in rows] == [execution_id, earlier]


async def test_filters_hold_for_the_list_and_a_row_leaving_the_status_filter_is_unlisted(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"filter-{unique}"
    await put(client, approval_workflow(workflow_id))
    await put(client, quick_workflow(f"other-{unique}"))
    done = await execute(client, f"other-{unique}", {})
    await wait_finished(client, done)

    async with live(client, f"workflowId={workflow_id}&status=paused&limit=5") as stream:
        assert await stream.rows() == []
        execution_id = await execute(client, workflow_id, {})
        # Not sent while running (it does not match), sent once paused.
        frame = await stream.next()
        assert (frame.event, frame.json["id"], frame.json["status"]) == (
            "execution",
            execution_id,
            "paused",
        )
        await client.post(f"/api/executions/{execution_id}/cancel")
        frame = await stream.next()
        assert frame.event == "execution:unlisted"
        assert frame.json["id"] == execution_id
        assert frame.json["status"] in ("running", "cancelled")
        # Whatever else it does now, it is not shown: nothing more for it.
        await wait_finished(client, execution_id)

    async with live(client, f"workflowId=other-{unique}&status=completed") as stream:
        assert [row["id"] for row in await stream.rows()] == [done]
    async with live(client, f"workflowId=other-{unique}&status=failed") as stream:
        assert await stream.rows() == []


@pytest.mark.parametrize(
    ("query", "code", "message"),
    [
        ("status=finished", "invalid_parameter", "status must be one of"),
        ("limit=0", "invalid_parameter", "limit must be between 1 and 200"),
        ("limit=201", "invalid_parameter", "limit must be between 1 and 200"),
        ("limit=many", "invalid_cursor", "limit must be a non-negative integer"),
    ],
)
async def test_a_bad_filter_is_400_with_what_was_wrong(
    client: httpx.AsyncClient, query: str, code: str, message: str
) -> None:
    response = await client.get(f"{LIVE}?{query}")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code
    assert message in response.json()["error"]["message"]


async def test_an_idle_live_list_gets_heartbeats(client: httpx.AsyncClient, unique: str) -> None:
    # The session server pings every second.
    async with client.stream("GET", f"{LIVE}?workflowId=idle-{unique}") as response:
        assert response.status_code == 200
        seen: list[Frame] = []
        async with asyncio.timeout(FRAME_SECONDS):
            async for frame in frames(response):
                seen.append(frame)
                if "ping" in frame.comments:
                    break
    assert seen[0].event == "executions"


async def test_an_open_live_list_counts_among_the_sse_clients(
    client: httpx.AsyncClient, unique: str
) -> None:
    # SPEC §10: "SSE clients connected": a live list is one, as much as a stream.
    async with live(client, f"workflowId=counted-{unique}") as shown:
        assert await shown.rows() == []

        async def counted() -> bool:
            return await sse_clients(client) >= 1

        await until(counted, "the live list counted", FRAME_SECONDS, every=0.05)


async def test_live_and_its_token_are_routes_of_their_own(client: httpx.AsyncClient) -> None:
    # No execution is called "live" (ids start with ex_), and GET /api/executions/live
    # is the live list, not the snapshot of such an execution.
    assert (await client.get("/api/executions/live/stream")).status_code == 404
    async with live(client) as stream:
        await stream.rows()
    token = await client.post(f"{LIVE}/token")
    assert token.status_code == 200
    assert token.json()["streamUrl"] == LIVE


def test_list_tokens_name_their_tenant_expire_and_never_pass_for_stream_tokens() -> None:
    tokens = StreamTokens(secret=b"s" * 32, lifetime_seconds=60)
    token = tokens.issue_list("t_abc", now=1_000)
    configured = ["t_other", "t_abc"]
    assert tokens.list_grant(token, configured, now=1_059) == ListGrant("t_abc", 1_060)
    assert tokens.list_grant(token, configured, now=1_061) is None
    assert tokens.list_grant(token, ["t_other"], now=1_000) is None  # its key taken out
    other = StreamTokens(secret=b"x" * 32, lifetime_seconds=60)
    assert other.list_grant(token, configured, now=1_000) is None
    # A list token opens no execution, an execution's token no list.
    assert not tokens.check(token, "list:t_abc", now=1_000)
    assert tokens.list_grant(tokens.issue("ex_1", now=1_000), configured, now=1_000) is None
    for odd in ("", "t_abc..x", "t_abc.²0.x", "ü.1.x", token + "="):
        assert tokens.list_grant(odd, configured, now=1_000) is None


def test_a_list_token_tells_nothing_of_its_tenant_or_key() -> None:
    """Step 16's review (row 10): list tokens began with the tenant, ``sha256(key)[:24]``
    unsalted, and the example key ``change-me`` was found from a token offline. The
    token now names its tenant by an HMAC under the server's secret."""
    tenant = tenant_of_key("change-me")
    token = StreamTokens(secret=b"s" * 32, lifetime_seconds=60).issue_list(tenant, now=1_000)
    assert tenant not in token and tenant.removeprefix("t_")[:8] not in token
    again = StreamTokens(secret=b"x" * 32, lifetime_seconds=60).issue_list(tenant, now=1_000)
    assert token.split(".")[0] != again.split(".")[0]


def test_a_token_handed_out_under_another_expires_no_later() -> None:
    tokens = StreamTokens(secret=b"s" * 32, lifetime_seconds=60)
    token = tokens.issue("ex_1", now=1_000, not_after=1_010)
    assert tokens.check(token, "ex_1", now=1_010)
    assert not tokens.check(token, "ex_1", now=1_011)
    assert tokens.issue("ex_1", now=1_000, not_after=9_999) == tokens.issue("ex_1", now=1_000)


def test_a_list_token_with_its_tenant_cut_off_opens_no_execution() -> None:
    # A list token is "<alias>.<expiry>.<mac>" with the mac over "list:<tenant>.<expiry>";
    # a stream token is "<expiry>.<mac>" with the mac over "<eid>.<expiry>". Without its
    # first part a list token is a well-formed stream token for the "execution"
    # "list:<tenant>": the tokens module promises neither kind ever passes for the
    # other, and no execution id contains ":".
    """Found by the step 14 review."""
    tokens = StreamTokens(secret=b"s" * 32, lifetime_seconds=60)
    token = tokens.issue_list("t_abc", now=1_000)
    cut = token.split(".", 1)[1]
    assert not tokens.check(cut, "list:t_abc", now=1_000)
    # An execution's own tokens still work.
    assert tokens.check(tokens.issue("ex_1", now=1_000), "ex_1", now=1_000)


# ---------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
async def pair(
    valkey: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[FlowcastServer, FlowcastServer]]:
    async with serving_pair(valkey, tmp_path_factory.mktemp("live-pair")) as servers:
        yield servers


async def test_an_execution_run_by_another_process_shows_and_finishes(
    pair: tuple[FlowcastServer, FlowcastServer], unique: str
) -> None:
    a, b = pair
    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
        httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
    ):
        workflow_id = f"pair-{unique}"
        await put(on_a, approval_workflow(workflow_id))
        async with live(on_b, f"workflowId={workflow_id}") as stream:
            assert await stream.rows() == []
            execution_id = await execute(on_a, workflow_id, {})
            assert await stream.until(execution_id, "running") == ["running"]
            assert await stream.until(execution_id, "paused") == ["paused"]
            # Resumed through B: A ran it, whichever runs it now, B's list shows it.
            resumed = await on_b.post(f"/api/executions/{execution_id}/resume", json={})
            assert resumed.status_code == 202, resumed.text
            await stream.until(execution_id, "completed")


# ---------------------------------------------------------------- API keys


@pytest.fixture(scope="module")
async def keyed(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer
) -> AsyncIterator[FlowcastServer]:
    root = tmp_path_factory.mktemp("live-keyed")
    keys = f"{ALICE},{BOB},{CAROL}"
    async with serving(valkey, root, api_keys=keys, max_streams_per_tenant="2") as server:
        yield server


@pytest.fixture
async def alice(keyed: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with authed(keyed, ALICE) as client:
        yield client


@pytest.fixture
async def anonymous(keyed: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with authed(keyed) as client:
        yield client


async def test_the_live_list_needs_a_key_or_a_list_token(
    alice: httpx.AsyncClient, anonymous: httpx.AsyncClient, unique: str
) -> None:
    await put(alice, quick_workflow(f"auth-{unique}"))
    started = await start_execution(alice, f"auth-{unique}", {})
    for headers in ({}, bearer("wrong-key"), {"Authorization": "Basic abc"}):
        for method, url in (("GET", LIVE), ("POST", f"{LIVE}/token")):
            response = await anonymous.request(method, url, headers=headers)
            assert response.status_code == 401, (method, headers)
            assert response.headers["www-authenticate"] == "Bearer"

    issued = (await alice.post(f"{LIVE}/token")).json()
    token = issued["streamToken"]
    assert issued["streamUrl"] == LIVE
    # Not an execution's stream token, not a tampered list token, not on other routes.
    tampered = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    for wrong in (started["streamToken"], tampered, "t_x.1.abc", "A" * 22 + ".1." + "B" * 43, ""):
        response = await anonymous.get(f"{LIVE}?token={wrong}")
        assert response.status_code == 401, wrong
    assert (await anonymous.get(f"/api/executions?token={token}")).status_code == 401
    stream_url = f"/api/executions/{started['executionId']}/stream?token={token}"
    assert (await anonymous.get(stream_url)).status_code == 401

    # With the list token: the list, each row with a token that opens its stream.
    await wait_finished(alice, started["executionId"])
    async with live(anonymous, f"workflowId=auth-{unique}&token={token}") as stream:
        (row,) = await stream.rows()
    assert row["id"] == started["executionId"]
    response, replayed = await collect(
        anonymous, f"/api/executions/{row['id']}/stream?token={row['streamToken']}"
    )
    assert response.status_code == 200
    assert replayed[-1].event == "execution:completed"


async def test_each_tenant_sees_only_its_own_executions_live(
    keyed: FlowcastServer, alice: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"mine-{unique}"
    await put(alice, quick_workflow(workflow_id))
    async with authed(keyed, BOB) as bob:
        await put(bob, quick_workflow(workflow_id))
        token = (await bob.post(f"{LIVE}/token")).json()["streamToken"]
        async with (
            httpx.AsyncClient(base_url=keyed.url, timeout=20) as anonymous,
            live(anonymous, f"workflowId={workflow_id}&token={token}") as bobs,
            live(alice, f"workflowId={workflow_id}") as alices,
        ):
            assert await bobs.rows() == [] and await alices.rows() == []
            alices_run = await execute(alice, workflow_id, {})
            bobs_run = await execute(bob, workflow_id, {})
            await alices.until(alices_run, "completed")
            # Bob's stream has only Bob's run, in order, though Alice's came first.
            await bobs.until(bobs_run, "completed")


async def test_live_lists_count_among_the_tenants_streams(keyed: FlowcastServer) -> None:
    async with authed(keyed, CAROL) as carol:
        async with live(carol) as first, live(carol) as second:
            await first.rows()
            await second.rows()
            refused = await carol.get(LIVE)
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "too_many_streams"
            assert refused.headers["retry-after"]
        # Both closed: their slots come back as the server sees the clients leave.

        async def let_in() -> bool:
            async with carol.stream("GET", LIVE) as response:
                assert response.status_code in (200, 429), response.status_code
                return response.status_code == 200

        await until(let_in, "a slot came back", FRAME_SECONDS, every=0.05)


# ---------------------------------------------------------------- reconnects and shutdown


async def test_after_a_pubsub_reconnect_the_list_is_sent_again(
    own_valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    server = FlowcastServer(data_dir=tmp_path, env={"FLOWCAST_REDIS_URL": own_valkey.url})
    await server.start()
    redis = Redis.from_url(own_valkey.url)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            workflow_id = f"re-{unique}"
            await put(client, quick_workflow(workflow_id))
            async with live(client, f"workflowId={workflow_id}") as stream:
                assert await stream.rows() == []
                # Messages published while the connection is down are lost: the list
                # is read again once it is back, and then changes come as before.
                killed = await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                assert killed >= 1
                assert await stream.rows() == []
                execution_id = await execute(client, workflow_id, {})
                await stream.until(execution_id, "completed")
    finally:
        await redis.aclose()
        await server.stop()


async def test_a_server_shutting_down_ends_its_live_lists(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    server = await flowcast_on(valkey, tmp_path, shutdown_grace_seconds="1")
    stopping: asyncio.Task[int] | None = None
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        async with live(client) as stream:
            await stream.rows()
            stopping = asyncio.create_task(server.stop(signal.SIGTERM))
            # A clean end: the body finishes; a cut one raises RemoteProtocolError here.
            assert await stream.rest() == []
    await stopping
    assert "ending the open streams" in server.logs()
    assert "without completing response" not in server.logs()


async def test_nothing_a_list_token_grants_outlives_it(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    """Step 16's review (row 9): an open live list kept handing out fresh stream tokens
    after its list token expired (reopening was 401), so one list token granted reads for
    about three times its lifetime. The list now ends when its token expires, and the
    tokens of its rows expire no later; the page then asks for a new list token."""
    async with serving(valkey, tmp_path, api_keys=ALICE, stream_token_seconds="3") as server:
        async with authed(server, ALICE) as alice, authed(server) as anonymous:
            workflow_id = f"expiring-{unique}"
            await put(alice, quick_workflow(workflow_id))
            token = (await alice.post(f"{LIVE}/token")).json()["streamToken"]
            expires = int(token.split(".")[1])
            async with live(anonymous, f"workflowId={workflow_id}&token={token}") as stream:
                assert await stream.rows() == []
                await stream.until(await execute(alice, workflow_id, {}), "completed")
                assert int(stream.row["streamToken"].split(".")[0]) <= expires
                await stream.rest()  # the server ends it
            assert time.time() >= expires - 1  # at the token's expiry, not before
            assert (await anonymous.get(f"{LIVE}?token={token}")).status_code == 401
