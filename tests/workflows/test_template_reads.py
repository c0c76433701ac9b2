"""What templates and ``when`` conditions read: blocks that exist, and keys that may not.

Issue 26 (step 18): ``when: "blocks.zzz.output"`` was stored (201) and its block was
skipped without a word; a template computing with a missing input key failed with
Jinja's "'dict object' has no attribute 'amount'". Through a real server over HTTP.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest

from tests.support.api import execute, put, wait_finished

ADVICE = (
    "a missing value cannot be computed with or compared; "
    "give it a fallback with default(…), or test it with `is defined`"
)


def chain(workflow_id: str, *blocks: dict[str, Any], when: str | None = None) -> dict[str, Any]:
    edges = [{"from": a["id"], "to": b["id"]} for a, b in itertools.pairwise(blocks)]
    if when is not None:
        edges[-1]["when"] = when
    return {"id": workflow_id, "blocks": list(blocks), "edges": edges}


def transform(block_id: str, value: Any) -> dict[str, Any]:
    return {"id": block_id, "type": "transform", "config": {"value": value}}


@pytest.mark.timeout(30)
async def test_reads_of_unknown_blocks_are_refused_when_stored_with_their_paths(
    client: httpx.AsyncClient, unique: str
) -> None:
    workflow_id = f"reads-{unique}"
    workflow = chain(
        workflow_id,
        transform("draft", {"text": "{{ input.text }}"}),
        transform("send", {"text": "{{ blocks.drafts.output.text }}", "n": ["{{ blocks['x'] }}"]}),
        when="blocks.zzz.output.approved",
    )
    response = await client.put(f"/api/workflows/{workflow_id}", json=workflow)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_workflow"
    assert error["problems"] == [
        {
            "path": "$.blocks[1].config.value.n[0]",
            "message": "unknown block 'x' in blocks.x (blocks: draft, send)",
        },
        {
            "path": "$.blocks[1].config.value.text",
            "message": "unknown block 'drafts' in blocks.drafts (blocks: draft, send)",
        },
        {
            "path": "$.edges[0].when",
            "message": "unknown block 'zzz' in blocks.zzz (blocks: draft, send)",
        },
    ]
    assert (await client.get(f"/api/workflows/{workflow_id}")).status_code == 404
    # Known blocks are fine wherever they are defined, and so are a loop's own names.
    workflow = chain(
        workflow_id,
        transform("draft", {"text": "{{ input.text }}"}),
        transform(
            "send",
            {
                "text": "{{ blocks.draft.output.text }}",
                "all": "{% for id in blocks %}{{ id }}{% endfor %}",
                "pairs": "{{ blocks.items() | list | length }}",
            },
        ),
        when="blocks['draft'].output.text",
    )
    await put(client, workflow)


@pytest.mark.timeout(30)
async def test_a_missing_input_key_is_null_empty_or_false_and_an_error_when_computed_with(
    client: httpx.AsyncClient, unique: str
) -> None:
    reads = f"missing-{unique}"
    value = {
        "whole": "{{ input.amount }}",
        "text": "amount: {{ input.amount }}.",
        "fallback": "{{ input.amount | default(25) }}",
        "defined": "{{ input.amount is defined }}",
        "deep": "{{ input.order.lines[0].sku }}",
    }
    workflow = chain(reads, transform("start", 1), transform("gate", 1), when="input.go")
    workflow["blocks"].append(transform("read", value))
    await put(client, workflow)
    snapshot = await wait_finished(client, await execute(client, reads, {}), timeout=None)
    assert snapshot["status"] == "completed", snapshot
    # `gate` is skipped by its condition on a missing key (false): only `read` answers.
    assert snapshot["output"] == {
        "read": {"whole": None, "text": "amount: .", "fallback": 25, "defined": False, "deep": None}
    }

    for source in ("{{ input.amount * 2 }}", "{% if input.amount > 100 %}big{% endif %}"):
        computes = f"computes-{unique}"
        await put(client, chain(computes, transform("double", source)))
        snapshot = await wait_finished(client, await execute(client, computes, {}), timeout=None)
        assert snapshot["status"] == "failed", snapshot
        assert snapshot["error"]["code"] == "template_error", snapshot
        assert snapshot["error"]["message"].endswith(f"the key 'amount' is missing: {ADVICE}")
