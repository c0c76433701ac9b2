"""Webhook attempts are shared fairly between tenants (SPEC §15): one tenant whose
receiver never answers does not hold up another tenant's deliveries."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.support.api import put, quick_workflow
from tests.support.receiver import HANG, Receiver, receiving
from tests.support.servers import ALPHA, BETA, ValkeyServer, authed, serving

# An attempt of the stuck tenant holds its slot this long: a delivery queued behind its
# backlog would wait several of these.
STUCK_SECONDS = 3.0


async def delivered_after(client: httpx.AsyncClient, receiver: Receiver, workflow_id: str) -> float:
    """Seconds from an execute to its delivery's arrival at ``receiver``."""
    before = len(receiver.received)
    began = time.monotonic()
    answer = await client.post(
        f"/api/workflows/{workflow_id}/execute",
        json={"input": {}, "webhook": {"url": receiver.url}},
    )
    assert answer.status_code == 202, answer.text
    await receiver.wait_for(before + 1)
    return time.monotonic() - began


@pytest.mark.timeout(90)
async def test_a_tenant_whose_receiver_never_answers_does_not_delay_another_tenants(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    async with (
        serving(
            valkey,
            tmp_path,
            api_keys=f"{ALPHA},{BETA}",
            http_allow_private="true",
            webhook_concurrency="2",
            webhook_timeout_seconds=str(STUCK_SECONDS),
            webhook_retry_seconds="0.1,0.1,0.1",
        ) as server,
        authed(server, ALPHA) as alpha,
        authed(server, BETA) as beta,
        receiving(then=HANG) as stuck,
        receiving() as prompt,
    ):
        await put(alpha, quick_workflow("flood"))
        await put(beta, quick_workflow("quick"))
        probe = await delivered_after(beta, prompt, "quick")
        for _ in range(6):
            answer = await alpha.post(
                "/api/workflows/flood/execute", json={"input": {}, "webhook": {"url": stuck.url}}
            )
            assert answer.status_code == 202, answer.text
        await stuck.wait_for(1)  # alpha's attempts are hanging now
        loaded = await delivered_after(beta, prompt, "quick")
        # Alpha holds at most half of the two attempts at once: beta's goes at once.
        assert loaded < probe + STUCK_SECONDS / 2, (loaded, probe)
        assert len(stuck.received) <= 2
