"""The CLI across the store's losses (SPEC §7, §9): an answer the server holds for a
moment (503 ``pause_held`` with ``Retry-After``, after Redis came back empty) is sent
again when the server says, not given up on."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.cli.test_cli import flowcast
from tests.support.api import execute, put, until
from tests.support.faults import FaultyValkey, crash_and_wipe, replica
from tests.support.recovery import (
    approval_flow,
    finished,
    has_event,
    http_for,
    meta_field,
    running,
    settled,
    valkey,
)

__all__ = ["settled", "valkey"]  # the module's FaultyValkey (tests/support/recovery.py)


@pytest.mark.timeout(90)
async def test_resume_of_a_pause_held_after_redis_came_back_empty_waits_and_succeeds(
    valkey: FaultyValkey, tmp_path: Path
) -> None:
    """Paused on A; Valkey comes back empty and A stores the pause again, held for a
    lease (4 s: claim.lua HELD). ``flowcast resume`` sent at once is answered 503
    pause_held, Retry-After: 4. The CLI retried twice within about half a second,
    ignoring Retry-After, and exited with the 503 while the server had said when to
    come back; it now waits what the server asks, and the resume is accepted."""
    a = replica(valkey, tmp_path, "a", FLOWCAST_LEASE_SECONDS="4")
    wf = approval_flow("cli-held")
    async with running(a), httpx.AsyncClient(timeout=30) as http:
        await put(http_for(http, a), wf)
        eid = await execute(http_for(http, a), wf["id"])
        await until(lambda: has_event(http_for(http, a), eid, "execution:paused"), "paused")
        await crash_and_wipe(valkey)

        async def held() -> bool:
            return await meta_field(valkey, eid, "held") is not None

        await until(held, "A stored the pause again, held")
        result = await flowcast("resume", eid, "--input", '{"ok": true}', url=a.url, timeout=60)
        assert result.code == 0, (result.code, result.err)
        snapshot = await finished(http_for(http, a), eid)
    assert snapshot["output"] == {"echo": {"ok": True}}, snapshot
