"""What one execution holds in a replica's memory is bounded (SPEC §8 "Shares per
tenant", FLOWCAST_EXECUTION_MEMORY_BYTES; lib/workflows/holdings.py).

Found by the step 16 hostile-tenant review (issue 24, row 4): one execution rendering a
large input over and over OOM-killed its replicas, and the runs beside it with them.
Row 3 bounds what one block config renders to; this bounds what a run holds besides:
its input, its kept outputs, and the stored values its templates load back, each
sized before it is read. On a real server (a 4 MiB bound, values over 64 KiB stored
as refs) and the session's Valkey.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import all_events, execute, put, wait_finished
from tests.support.servers import ValkeyServer, serving

pytestmark = pytest.mark.timeout(90)

MIB = 1024 * 1024


def echo_twice(workflow_id: str) -> dict[str, Any]:
    """first: the input's ``s`` (stored as a ref when large) → second: first's output."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "first", "type": "transform", "config": {"value": "{{ input.s }}"}},
            {"id": "second", "type": "transform", "config": {"value": "{{ blocks.first.output }}"}},
        ],
        "edges": [{"from": "first", "to": "second"}],
    }


async def test_a_block_that_would_load_more_than_its_execution_may_hold_fails_before_reading(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """With a 4 MiB bound, a 1 MiB string echoed twice completes (1 MiB held, 1 MiB
    loaded back); a 3 MiB one fails at ``second`` with ``execution_memory`` (3 MiB held
    as input, 3 MiB more to load), with a message naming the sizes and the setting, and
    nothing after it runs."""
    settings = {
        "execution_memory_bytes": str(4 * MIB),
        "large_value_bytes": str(64 * 1024),
        "template_max_bytes": str(8 * MIB),
    }
    async with (
        serving(valkey, tmp_path, **settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        await put(http, echo_twice("echo"))
        small = await execute(http, "echo", {"s": "x" * MIB})
        large = await execute(http, "echo", {"s": "y" * (3 * MIB)})
        done = await wait_finished(http, small)
        failed = await wait_finished(http, large)
        events = await all_events(http, large)

    assert done["status"] == "completed", done
    assert failed["status"] == "failed", failed
    error = failed["error"]
    assert (error["code"], error["blockId"]) == ("execution_memory", "second"), error
    assert "3.0 MiB" in error["message"] and "FLOWCAST_EXECUTION_MEMORY_BYTES" in error["message"]
    completed = [e["data"]["blockId"] for e in events if e["type"] == "block:completed"]
    assert completed == ["first"], completed
    refused = [e["data"] for e in events if e["type"] == "block:failed"]
    assert [(r["blockId"], r["willRetry"]) for r in refused] == [("second", False)], refused


async def test_a_condition_that_would_load_more_than_its_execution_may_hold_fails_its_block(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    """A ``when`` reads stored values back as a template does, under the same bound: the
    3 MiB string's condition fails ``second`` with ``execution_memory``; the 1 MiB one's
    is judged and taken."""
    settings = {
        "execution_memory_bytes": str(4 * MIB),
        "large_value_bytes": str(64 * 1024),
        "template_max_bytes": str(8 * MIB),
    }
    workflow = echo_twice("judged")
    workflow["blocks"][1]["config"] = {"value": 1}
    workflow["edges"][0]["when"] = "blocks.first.output | length > 0"
    async with (
        serving(valkey, tmp_path, **settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        await put(http, workflow)
        small = await execute(http, "judged", {"s": "x" * MIB})
        large = await execute(http, "judged", {"s": "y" * (3 * MIB)})
        done = await wait_finished(http, small)
        failed = await wait_finished(http, large)

    assert done["status"] == "completed", done
    assert done["output"] == {"second": 1}, done
    error = failed["error"]
    assert (failed["status"], error["code"], error["blockId"]) == (
        "failed", "execution_memory", "second",
    ), failed  # fmt: skip
