from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from lib.errors import WorkflowInvalid
from lib.workflows import limits
from lib.workflows.blocks import BlockTypes
from lib.workflows.limits import too_deep, too_deep_in_slices
from lib.workflows.model import Workflow
from lib.workflows.templates import Templates
from lib.workflows.validation import validate_workflow


async def _noop(ctx: Any, args: Any) -> Any:
    return args


def problems_of(raw: Any) -> dict[str, str]:
    """Validate and return {path: message} of the problems (failing if there are none)."""
    with pytest.raises(WorkflowInvalid) as caught:
        validate_workflow(
            raw, block_types=BlockTypes.builtin({"known": _noop}), templates=Templates()
        )
    return {problem.path: problem.message for problem in caught.value.problems}


def test_valid_workflow_is_returned_as_model() -> None:
    raw = {
        "id": "triage",
        "name": "Triage",
        "blocks": [
            {"id": "fetch", "type": "http", "config": {"url": "{{ input.url }}"}},
            {"id": "wait", "type": "delay", "config": {"ms": "{{ input.ms }}"}, "timeoutMs": 5},
            {"id": "run", "type": "python", "config": {"name": "known", "args": {"a": 1}}},
        ],
        "edges": [
            {"from": "fetch", "to": "wait", "when": "blocks.fetch.output.status == 200"},
            {"from": "wait", "to": "run"},
        ],
    }
    workflow = validate_workflow(
        raw, block_types=BlockTypes.builtin({"known": _noop}), templates=Templates()
    )
    assert isinstance(workflow, Workflow)
    assert workflow.to_json() == raw | {"description": ""}


def test_every_problem_is_reported_at_once_with_paths() -> None:
    raw = {
        "id": "Bad Id",
        "colour": "red",
        "blocks": [
            {"id": "a", "type": "nope"},
            {"id": "b", "type": "delay", "config": {"ms": -1, "extra": True}},
            {"id": "a", "type": "transform", "config": {"value": "{{ broken"}},
            {"id": "c", "type": "http", "config": {"url": "ftp://x", "method": "BREW"}},
            {"id": "d", "type": "python", "config": {"name": "missing"}},
            {"id": "e", "type": "approval", "config": {"prompt": "ok?", "schema": {"type": 5}}},
            {"id": "f", "type": "transform", "retry": {"attempts": 0}, "foo": 1},
        ],
        "edges": [
            {"from": "a", "to": "ghost"},
            {"from": "b", "to": "b"},
            {"from": "b", "to": "c", "when": "input.x =="},
            {"from": "b", "to": "c"},
        ],
    }
    problems = problems_of(raw)
    expected = {
        "$.id": "slug",
        "$.colour": "unknown field",
        "$.blocks[0].type": "unknown block type 'nope'",
        "$.blocks[1].config.ms": "greater than or equal to 0",
        "$.blocks[1].config.extra": "unknown field",
        "$.blocks[2].id": "duplicate block id 'a'",
        "$.blocks[2].config.value": "unparsable template",
        "$.blocks[3].config.url": "http",
        "$.blocks[3].config.method": "GET",
        "$.blocks[4].config.name": "unknown plugin block 'missing'",
        "$.blocks[5].config.schema": "not a valid JSON Schema",
        "$.blocks[6].retry.attempts": "greater than or equal to 1",
        "$.blocks[6].foo": "unknown field",
        "$.edges[0].to": "unknown block 'ghost'",
        "$.edges[1].to": "itself",
        "$.edges[2].when": "unparsable expression",
        "$.edges[3]": "duplicate edge",
    }
    for path, fragment in expected.items():
        assert path in problems, f"{path} not reported; got {problems}"
        assert fragment in problems[path]
    assert set(problems) == set(expected)


def test_cycle_is_reported_with_its_block_ids() -> None:
    raw = {
        "id": "loop",
        "blocks": [{"id": name, "type": "transform"} for name in ("a", "b", "c", "d")],
        "edges": [
            {"from": "a", "to": "b"},
            {"from": "b", "to": "c"},
            {"from": "c", "to": "d"},
            {"from": "d", "to": "b"},
        ],
    }
    assert problems_of(raw) == {"$.edges[3]": "this edge closes a cycle: b → c → d → b"}


def test_long_chain_does_not_hit_the_recursion_limit() -> None:
    blocks = [{"id": f"b{i}", "type": "transform"} for i in range(500)]
    edges = [{"from": f"b{i}", "to": f"b{i + 1}"} for i in range(499)] + [
        {"from": "b499", "to": "b0"}
    ]
    problems = problems_of({"id": "chain", "blocks": blocks, "edges": edges})
    assert list(problems) == ["$.edges[499]"]


def test_templated_numbers_are_accepted_at_registration() -> None:
    raw = {
        "id": "t",
        "blocks": [
            {"id": "p", "type": "payload", "config": {"bytes": "{{ input.size }}"}},
            {"id": "g", "type": "generate", "config": {"text": "x", "tokensPerSecond": "{{ 5 }}"}},
        ],
    }
    validate_workflow(raw, block_types=BlockTypes.builtin(), templates=Templates())


def test_missing_config_field_is_reported() -> None:
    raw = {"id": "t", "blocks": [{"id": "d", "type": "delay"}]}
    assert problems_of(raw) == {"$.blocks[0].config.ms": "Field required"}


def test_structure_so_broken_still_reports_what_it_can() -> None:
    raw = {
        "id": "t",
        "blocks": [{"id": "a", "type": "nope"}, "not a block", {"type": 3}],
        "edges": "nope",
    }
    problems = problems_of(raw)
    assert "$.blocks[0].type" in problems
    assert "$.blocks[1]" in problems
    assert "$.blocks[2].id" in problems
    assert "$.blocks[2].type" in problems
    assert "$.edges" in problems


@pytest.mark.parametrize("raw", [None, [], "workflow", 3])
def test_non_object_is_refused(raw: Any) -> None:
    assert problems_of(raw) == {"$": "a workflow must be a JSON object"}


def test_empty_blocks_are_refused() -> None:
    assert list(problems_of({"id": "t", "blocks": []})) == ["$.blocks"]


def _depth(value: object) -> int:
    """The nesting depth by definition: a walk."""
    if isinstance(value, dict):
        return 1 + max((_depth(item) for item in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(item) for item in value), default=0)
    return 0


def test_the_depth_check_agrees_with_a_walk_whatever_the_strings_hold() -> None:
    """Step 16's review (row 1): the depth check walked an input on the event loop, an
    element at a time (5 million zeros: a second of every tenant's time). It now reads
    the value's JSON in C; brackets inside strings, objects inside lists, and values
    just under and over the limit give what the walk gives."""
    rng = random.Random(16)

    def shape(depth: int, budget: list[int]) -> object:
        if depth == 0 or budget[0] <= 0 or rng.random() < 0.1:
            return rng.choice([1, "a[b", None, '\\"{', "}]", 2.5])
        budget[0] -= 1
        width = 1 if rng.random() < 0.7 else 2
        if rng.random() < 0.5:
            return [shape(depth - 1, budget) for _ in range(width)]
        return {f'{n}]"{{': shape(depth - 1, budget) for n in range(width)}

    for _ in range(2000):
        value, limit = shape(rng.randint(0, 90), [200]), rng.randint(1, 80)
        assert too_deep(value, limit) == (_depth(value) > limit), value
    assert not too_deep({"z": [0] * 1_000_000})
    assert not too_deep([{}] * 1_000_000)
    assert too_deep([10**30, [[[1]]]], 3)  # not JSON orjson takes: walked instead


async def test_the_depth_check_in_slices_answers_as_the_whole_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large input's depth is read from its JSON in windows (the event loop runs
    between them): cut into windows of 1-7 bytes (inside strings, escapes and runs of
    backslashes), random shapes give what the whole check gives."""
    rng = random.Random(24)
    escapes = ['\\"[', "\\\\", '"]{', "[\\\\]", "x\\"]

    def shape(depth: int, budget: list[int]) -> object:
        if depth == 0 or budget[0] <= 0 or rng.random() < 0.15:
            return rng.choice([1, None, 2.5, *escapes])
        budget[0] -= 1
        width = 1 if rng.random() < 0.7 else 2
        if rng.random() < 0.5:
            return [shape(depth - 1, budget) for _ in range(width)]
        return {rng.choice(escapes) + str(n): shape(depth - 1, budget) for n in range(width)}

    for _ in range(1500):
        monkeypatch.setattr(limits, "DEPTH_WINDOW", rng.randint(1, 7))
        value, limit = shape(rng.randint(0, 90), [120]), rng.randint(1, 80)
        encoded = orjson.dumps(value)
        assert await too_deep_in_slices(encoded, limit) == too_deep(value, limit), encoded
