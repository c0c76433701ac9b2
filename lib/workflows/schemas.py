"""Approval schemas are tenant data: checked without fetching anything, in linear time.

A schema may ``$ref`` only inside itself: the validator's registry retrieves nothing,
so no URL and no file is ever read for a tenant. ``pattern`` and ``patternProperties``
run on RE2, whose matching time is linear in the input, so no pattern (``^(a+)+$``)
can stall the server; a pattern RE2 cannot run (a backreference, a lookaround) is
refused when the schema is checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import re2  # type: ignore[import-untyped]
from jsonschema import ValidationError
from jsonschema.exceptions import SchemaError
from jsonschema.validators import extend, validator_for
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource

from lib.errors import Problem, error_path


def _retrieve_nothing(uri: str) -> Resource[Any]:
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


_REGISTRY: Registry[Any] = Registry(retrieve=_retrieve_nothing)  # type: ignore[call-arg]


def _compiled(pattern: str) -> Any:
    try:
        return re2.compile(pattern)
    except re2.error as exc:
        raise SchemaError(f"the pattern {pattern!r} is not supported: {exc}") from exc


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if isinstance(instance, str) and not _compiled(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[Any]:
    if not isinstance(instance, dict):
        return
    for pattern, subschema in patterns.items():
        compiled = _compiled(pattern)
        for name, value in instance.items():
            if compiled.search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _validator(schema: dict[str, Any]) -> Any:
    base = validator_for(schema)
    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties}
    linear = extend(base, keywords)  # type: ignore[no-untyped-call]
    return linear(schema, registry=_REGISTRY)


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse (SchemaError) a schema that is invalid, refers outside itself, or has a
    pattern RE2 cannot run."""
    validator_for(schema).check_schema(schema)
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} points outside the schema; only '#…' refs are allowed")
    for pattern in _patterns(schema):
        _compiled(pattern)


def answer_problems(schema: dict[str, Any], answer: Any) -> list[Problem]:
    """Every way ``answer`` fails ``schema``, as problems under ``$.input``."""
    try:
        errors = list(_validator(schema).iter_errors(answer))
    except (SchemaError, NoSuchResource) as exc:
        return [Problem("$.input", f"the pause's schema cannot be used: {exc}")]
    except Exception as exc:  # an unresolvable $ref, reported by referencing
        if type(exc).__module__.startswith("referencing"):
            return [Problem("$.input", f"the pause's schema cannot be used: {exc}")]
        raise
    return [
        Problem("$.input" + error_path(tuple(error.absolute_path)), error.message)
        for error in errors
    ]


def _walk(value: Any) -> Iterator[dict[str, Any]]:
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            yield current
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)


def _refs(schema: dict[str, Any]) -> Iterator[str]:
    for node in _walk(schema):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref


def _patterns(schema: dict[str, Any]) -> Iterator[str]:
    for node in _walk(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        properties = node.get("patternProperties")
        if isinstance(properties, dict):
            yield from (key for key in properties if isinstance(key, str))
