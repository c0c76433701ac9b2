"""A delivery owed when Valkey comes back from an older snapshot (SPEC §15: deliveries
are durable, made at least once; §7: a store restored behind). The snapshot holds the
run still running, not its end, nor the hint or the delivery owed for it; the process
that ended the run stores its end again (finals.py): that end is owed its delivery all
the same, under the same ``webhook-id``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.api import delay_workflow, put, until, wait_status
from tests.support.faults import FaultyValkey, crash_and_restore, replica, take_snapshot
from tests.support.receiver import receiving
from tests.support.recovery import finished, http_for, running, settled, valkey

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)

# Far more than a hint's delay and an attempt on loopback.
DELIVERED_WITHIN = 20.0


@pytest.mark.timeout(120)
async def test_an_end_stored_again_after_a_restore_is_still_delivered(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    a = replica(
        valkey, tmp_path, "a",
        FLOWCAST_HTTP_ALLOW_PRIVATE="true",
        FLOWCAST_WEBHOOK_RETRY_SECONDS="600",  # no retry of the first attempt in the test
        FLOWCAST_SECRET_KEY="webhooks-restore-" + "k" * 32,
    )  # fmt: skip
    # The first attempt is answered 500 (before the crash), every later one 200.
    async with (
        running(a),
        httpx.AsyncClient(timeout=30) as http,
        receiving(500, then=200) as receiver,
    ):
        client = http_for(http, a)
        await put(client, delay_workflow("restored-hook", ms=2000))
        answer = await client.post(
            "/api/workflows/restored-hook/execute",
            json={"input": {}, "webhook": {"url": receiver.url}},
        )
        assert answer.status_code == 202, answer.text
        eid = answer.json()["executionId"]
        await wait_status(client, eid, "running")
        snap = await take_snapshot(valkey, tmp_path / "running.rdb")
        # Still running once the snapshot is taken: it holds neither the end nor the
        # delivery (a loaded machine could be slower than the run, and the test moot).
        still = (await client.get(f"/api/executions/{eid}")).json()
        assert still["status"] == "running" and not still.get("webhooks"), still
        [first] = await receiver.wait_for(1)
        assert orjson.loads(first.body)["type"] == "execution:completed"

        async def recorded() -> bool:
            hooks = (await client.get(f"/api/executions/{eid}")).json().get("webhooks")
            return bool(hooks) and hooks[0]["attempts"] == 1

        # The attempt's outcome stored before the crash. Its settle may still come after
        # the restore: it then reschedules nothing (outbox.lua "settle", XX), where it
        # once brought the delivery back due 600 s on, ahead of the end's new owe (a
        # clean-clone run: "pending", 0 attempts, never delivered).
        await until(recorded, "the first attempt recorded", 20)
        await crash_and_restore(valkey, snap)
        view = await finished(client, eid)
        assert view["status"] == "completed"
        try:
            async with asyncio.timeout(DELIVERED_WITHIN):
                requests = await receiver.wait_for(2)
        except TimeoutError:
            view = (await client.get(f"/api/executions/{eid}")).json()
            pytest.fail(f"the end stored again was never delivered: {view.get('webhooks')}")
    assert requests[1].headers["webhook-id"] == first.headers["webhook-id"]
    assert requests[1].body == first.body, "one webhook-id, two bodies"
    assert orjson.loads(requests[1].body)["type"] == "execution:completed"
