from __future__ import annotations

from lib.workflows.model import Workflow

RAW = {
    "id": "diamond",
    "blocks": [
        {"id": "a", "type": "transform", "retry": {"attempts": 2, "backoffMs": 10}},
        {"id": "b", "type": "transform", "timeoutMs": 100},
        {"id": "c", "type": "transform", "name": "Third"},
        {"id": "d", "type": "transform"},
        {"id": "lonely", "type": "transform"},
    ],
    "edges": [
        {"from": "a", "to": "c"},
        {"from": "a", "to": "b", "when": "input.x"},
        {"from": "b", "to": "d"},
        {"from": "c", "to": "d"},
    ],
}


def test_workflow_round_trips_with_spec_field_names() -> None:
    workflow = Workflow.model_validate(RAW)
    assert workflow.blocks[0].retry is not None and workflow.blocks[0].retry.backoff_ms == 10
    assert workflow.blocks[1].timeout_ms == 100
    assert workflow.edges[0].from_ == "a"
    dumped = workflow.to_json()
    assert dumped["edges"][1] == {"from": "a", "to": "b", "when": "input.x"}
    assert dumped["blocks"][0]["retry"] == {"attempts": 2, "backoffMs": 10}
    assert dumped["blocks"][1] == {"id": "b", "type": "transform", "config": {}, "timeoutMs": 100}
    assert Workflow.model_validate(dumped) == workflow


def test_graph_helpers() -> None:
    workflow = Workflow.model_validate(RAW)
    assert workflow.downstream()["a"] == ["b", "c"]
    assert [edge.from_ for edge in workflow.incoming()["d"]] == ["b", "c"]
    assert workflow.ancestors()["d"] == {"a", "b", "c"}
    assert workflow.ancestors()["a"] == frozenset()
    assert workflow.sinks() == ["d", "lonely"]
    assert workflow.block("c").name == "Third"
