"""Values checked against tenants' schemas (lib/workflows/schemas.py): within a CPU
bound, with short messages, whatever the value's size, and the same verdicts as
jsonschema's own where Flowcast replaces a keyword."""

from __future__ import annotations

import pytest
from jsonschema.exceptions import SchemaError

from lib.workflows.schemas import MAX_PROBLEMS, SchemaChecks, check_schema, value_problems


@pytest.mark.timeout(30)
def test_a_large_value_is_shown_shortened_in_the_message() -> None:
    (problem,) = value_problems({"type": "object"}, [0] * 1_000_000)
    assert problem.path == "$.input"
    assert problem.message == "[0, 0, 0, 0, 0, … (1000000 items)] is not of type 'object'"
    (long_text,) = value_problems({"maxLength": 3}, "x" * 1_000_000, where="$.exampleInput")
    assert long_text.path == "$.exampleInput"
    assert len(long_text.message) < 200, long_text.message


@pytest.mark.timeout(30)
def test_a_check_stops_at_its_cpu_bound_and_at_twenty_problems() -> None:
    schema = {"type": "array", "items": {"type": "integer", "maximum": 0}}
    (slow,) = value_problems(schema, [0] * 2_000_000, cpu_seconds=0.05, whose="the schema")
    assert slow.message == "checking it against the schema took too long (over 50 ms)"
    many = value_problems({"items": {"type": "string"}}, list(range(1000)))
    assert len(many) == MAX_PROBLEMS
    assert many[3].path == "$.input[3]"


@pytest.mark.timeout(30)
def test_refs_that_never_end_are_a_problem_not_a_crash() -> None:
    (problem,) = value_problems({"anyOf": [{"$ref": "#"}]}, {"a": 1}, whose="the pause's schema")
    assert problem.message == "the pause's schema cannot be used: its $refs never end"
    (missing,) = value_problems({"$ref": "#/$defs/nothing"}, 1)
    assert missing.message.startswith("the schema cannot be used")


@pytest.mark.parametrize(
    ("items", "unique"),
    [
        ([1, 1.0, *range(2, 100)], False),  # 1 == 1.0 in JSON Schema
        ([True, 1, *range(2, 100)], True),  # a boolean is not a number
        ([{"a": 1, "b": 2}, {"b": 2, "a": 1}, *range(100)], False),
        ([[1, 2], [2, 1], *range(2, 100)], True),
        (["1", 1, *range(2, 100)], True),
    ],
)
@pytest.mark.timeout(30)
def test_unique_items_of_a_long_array_agree_with_jsonschema(
    items: list[object], unique: bool
) -> None:
    problems = value_problems({"uniqueItems": True}, items)
    assert (not problems) is unique, problems


@pytest.mark.timeout(30)
async def test_checks_run_off_the_event_loop_one_at_a_time() -> None:
    checks = SchemaChecks(cpu_seconds=1.0)
    schema = {"properties": {"n": {"type": "integer"}}}
    problems = await checks.problems("t", schema, {"n": "x"}, whose="the workflow's inputSchema")
    assert [(p.path, p.message) for p in problems] == [
        ("$.input.n", "'x' is not of type 'integer'")
    ]
    assert await checks.problems("t", schema, {"n": 1}, whose="x") == []


@pytest.mark.timeout(30)
def test_a_ref_to_nothing_is_refused_when_the_schema_is_checked() -> None:
    with pytest.raises(SchemaError, match="points to nothing"):
        check_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}})
    check_schema({"$defs": {"n": {"type": "integer"}}, "items": {"$ref": "#/$defs/n"}})
    check_schema({"anyOf": [{"$ref": "#"}]})  # refers to itself: checked when used


@pytest.mark.timeout(30)
def test_a_schema_that_splits_at_every_level_of_a_deep_value_stops_at_the_bound() -> None:
    splitting = {
        "anyOf": [
            {"type": "array", "items": {"$ref": "#"}, "minItems": 2},
            {"type": "array", "items": {"$ref": "#"}},
        ]
    }
    deep: object = 0
    for _ in range(40):
        deep = [deep]
    (problem,) = value_problems(splitting, deep, cpu_seconds=0.1)
    assert "took too long (over 100 ms)" in problem.message
