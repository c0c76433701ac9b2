"""The workflows the scenarios run, and the checks of what their logs must contain."""

from __future__ import annotations

from collections import Counter
from typing import Any

from stress.harness import Report
from tests.support.logcheck import TERMINAL

APPROVAL_SCHEMA = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}, "note": {"type": "string"}},
}


def words(count: int, tag: str) -> str:
    return " ".join(f"{tag}w{i}" for i in range(count))


def fan_workflow(
    workflow_id: str,
    *,
    branches: int = 48,
    delay_ms: tuple[int, int] = (20, 200),
    words_per_branch: int = 8,
    tokens_per_second: float = 200,
) -> dict[str, Any]:
    """``branches`` parallel roots, alternately ``delay`` and ``generate``, joined by one
    sink; the delays spread over ``delay_ms`` and every other generate runs at full speed."""
    low, high = delay_ms
    blocks: list[dict[str, Any]] = []
    for index in range(branches):
        if index % 2 == 0:
            ms = low + (index * 37) % max(1, high - low)
            blocks.append({"id": f"b{index}", "type": "delay", "config": {"ms": ms}})
        else:
            tps = 0 if index % 4 == 1 else tokens_per_second
            config = {"text": words(words_per_branch, f"b{index}"), "tokensPerSecond": tps}
            blocks.append({"id": f"b{index}", "type": "generate", "config": config})
    blocks.append({"id": "sink", "type": "transform", "config": {"value": {"n": "{{ input.n }}"}}})
    edges = [{"from": f"b{index}", "to": "sink"} for index in range(branches)]
    return {"id": workflow_id, "blocks": blocks, "edges": edges}


def approval_workflow(workflow_id: str, *, words_after: int = 6) -> dict[str, Any]:
    """lead (delay) → ask (approval) → talk (generate) → done (echoes the resume input)."""
    return {
        "id": workflow_id,
        "blocks": [
            {"id": "lead", "type": "delay", "config": {"ms": 10}},
            {
                "id": "ask",
                "type": "approval",
                "config": {"prompt": "Go on with {{ input.n }}?", "schema": APPROVAL_SCHEMA},
            },
            {
                "id": "talk",
                "type": "generate",
                "config": {"text": words(words_after, "t"), "tokensPerSecond": 0},
            },
            {"id": "done", "type": "transform", "config": {"value": "{{ blocks.ask.output }}"}},
        ],
        "edges": [
            {"from": "lead", "to": "ask"},
            {"from": "ask", "to": "talk"},
            {"from": "talk", "to": "done"},
        ],
    }


def streaming_workflow(workflow_id: str, *, count: int, tokens_per_second: float) -> dict[str, Any]:
    """One long ``generate``: ``count`` chunks at ``tokens_per_second``."""
    return {
        "id": workflow_id,
        "blocks": [
            {
                "id": "talk",
                "type": "generate",
                "config": {"text": words(count, "s"), "tokensPerSecond": tokens_per_second},
            }
        ],
        "edges": [],
    }


def held_streaming_workflow(
    workflow_id: str, *, count: int, tokens_per_second: float
) -> dict[str, Any]:
    """``streaming_workflow``'s ``generate``, then an ``approval`` that holds the execution
    until it is resumed, then a ``transform`` that echoes the resume input: the
    execution ends when its driver says so, however long it streamed."""
    workflow = streaming_workflow(workflow_id, count=count, tokens_per_second=tokens_per_second)
    workflow["blocks"] += [
        {
            "id": "hold",
            "type": "approval",
            "config": {"prompt": "End {{ input.n }}?", "schema": APPROVAL_SCHEMA},
        },
        {"id": "done", "type": "transform", "config": {"value": "{{ blocks.hold.output }}"}},
    ]
    workflow["edges"] = [{"from": "talk", "to": "hold"}, {"from": "hold", "to": "done"}]
    return workflow


def check_work(report: Report, log: list[dict[str, Any]], workflow: dict[str, Any]) -> None:
    """Beyond the ids: every block started and completed exactly once, each generate's
    chunks join to its text, and the execution completed."""
    if not log:
        return
    execution_id = log[0]["executionId"]
    if log[-1]["type"] not in TERMINAL:
        return  # verify() reports the execution as never finished
    if log[-1]["type"] != "execution:completed":
        error = log[-1]["data"].get("error", {})
        report.find(f"{execution_id}: ended with {log[-1]['type']} {error.get('code')}")
        return
    started = Counter(e["data"]["blockId"] for e in log if e["type"] == "block:started")
    completed = Counter(e["data"]["blockId"] for e in log if e["type"] == "block:completed")
    for block in workflow["blocks"]:
        name = block["id"]
        if started[name] != 1 or completed[name] != 1:
            report.find(
                f"{execution_id}: block {name} started {started[name]}x, "
                f"completed {completed[name]}x"
            )
        if block["type"] == "generate":
            text = "".join(
                e["data"]["text"]
                for e in log
                if e["type"] == "block:chunk" and e["data"]["blockId"] == name
            )
            if text != block["config"]["text"]:
                report.find(f"{execution_id}: chunks of {name} join to {text[:80]!r}")
