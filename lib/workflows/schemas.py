"""Approval and input schemas are tenant data: checked without fetching anything, in
linear time, within a bound of CPU, off the event loop.

A schema may ``$ref`` only inside itself: the validator's registry retrieves nothing,
so no URL and no file is ever read for a tenant. ``pattern`` and ``patternProperties``
run on RE2, whose matching time is linear in the input, so no pattern (``^(a+)+$``)
can stall the server; a pattern RE2 cannot run (a backreference, a lookaround) is
refused when the schema is checked.

A value (a resume answer, an execution's input: up to 10 MB) is checked by
``value_problems`` in a thread, one at a time per process (``SchemaChecks``): every
keyword's call first looks at the thread's CPU clock, so a schema and value that would
take long stop at ``cpu_seconds`` with a problem that says so. Pure Python lets the
event loop take the GIL back every few milliseconds; the C calls jsonschema would make
over a whole large value are kept out of it: a message shows a large container or
string shortened (``repr`` of 5 million zeros held the GIL 0.25 s and made a 15 MB
message), and ``uniqueItems`` over a long array hashes its items instead of sorting
them.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import orjson
import re2  # type: ignore[import-untyped]
from jsonschema import ValidationError
from jsonschema.exceptions import SchemaError
from jsonschema.validators import extend, validator_for
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource, Unresolvable
from referencing.jsonschema import DRAFT202012

from lib.errors import Problem, error_path
from lib.slices import PIECE
from lib.tenancy import FairGate


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
    return _bounded_class(validator_for(schema))(schema, registry=_REGISTRY)


@functools.cache
def _bounded_class(base: Any) -> Any:
    """``base`` with RE2 patterns, a hashed ``uniqueItems``, and every keyword timed
    and shown its instance shortened (worked out once per draft)."""
    keywords = {
        **base.VALIDATORS,
        "pattern": _pattern,
        "patternProperties": _pattern_properties,
    }
    if "uniqueItems" in keywords:
        keywords["uniqueItems"] = _unique_items(keywords["uniqueItems"])
    timed = {name: _timed(keyword) for name, keyword in keywords.items()}
    return extend(base, timed)  # type: ignore[no-untyped-call]


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse (SchemaError) a schema that is invalid, refers outside itself, or has a
    pattern RE2 cannot run."""
    validator_for(schema).check_schema(schema)
    refs = list(_refs(schema))
    for ref in refs:
        if not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} points outside the schema; only '#…' refs are allowed")
    if refs and not _has_inner_id(schema):  # with an inner $id, a '#…' ref may be its
        resource = Resource.from_contents(schema, default_specification=DRAFT202012)
        resolver = _REGISTRY.with_resource("", resource).resolver()
        for ref in refs:
            try:
                resolver.lookup(ref)
            except Unresolvable:
                raise SchemaError(f"$ref {ref!r} points to nothing in the schema") from None
    for pattern in _patterns(schema):
        _compiled(pattern)


# A refusal lists at most this many problems, each message and path cut to this length:
# an answer of a million wrong items is not worth a million lines back.
MAX_PROBLEMS = 20
MAX_TEXT = 400


def value_problems(
    schema: dict[str, Any],
    value: Any,
    *,
    where: str = "$.input",
    whose: str = "the schema",
    cpu_seconds: float = 1.0,
) -> list[Problem]:
    """Every way ``value`` fails ``schema`` (the first ``MAX_PROBLEMS``), as problems
    under ``where``; past ``cpu_seconds`` of this thread's CPU, one problem saying so.
    Run it in a thread (``SchemaChecks``): it takes what the value's size costs."""
    clock = _CLOCK
    clock.deadline = time.thread_time() + cpu_seconds
    clock.shown = {}
    try:
        errors = list(islice(_validator(schema).iter_errors(value), MAX_PROBLEMS))
        return [
            Problem(_cut(where + error_path(tuple(error.absolute_path))), _cut(str(error.message)))
            for error in errors
        ]
    except _OutOfTime:
        message = f"checking it against {whose} took too long (over {cpu_seconds * 1000:g} ms)"
        return [Problem(where, message)]
    except RecursionError:
        return [Problem(where, f"{whose} cannot be used: its $refs never end")]
    except (SchemaError, NoSuchResource, Unresolvable) as exc:  # a $ref to nothing
        return [Problem(where, _cut(f"{whose} cannot be used: {exc}"))]
    finally:
        clock.deadline = None
        clock.shown = {}


class SchemaChecks:
    """Checks values against schemas in a thread, one at a time per process, the
    tenants waiting taking turns; each check within ``cpu_seconds`` of CPU."""

    def __init__(self, *, cpu_seconds: float = 1.0) -> None:
        self.cpu_seconds = cpu_seconds
        self._gate = FairGate(1)

    async def problems(
        self, tenant: str, schema: dict[str, Any], value: Any, *, whose: str
    ) -> list[Problem]:
        """``value_problems`` of ``value`` (a request's ``input``) against ``schema``."""
        check = functools.partial(
            value_problems, schema, value, whose=whose, cpu_seconds=self.cpu_seconds
        )
        async with self._gate.entered(tenant):
            return await asyncio.to_thread(check)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


class _OutOfTime(Exception):
    """The check used up its CPU."""


class _Clock(threading.local):
    """The running check's CPU deadline and the shortened stand-ins of its large values
    (by id, the original kept beside so the id stays its own), for this thread."""

    deadline: float | None = None
    shown: dict[int, tuple[Any, Any]] = {}  # noqa: RUF012 (replaced per check)


_CLOCK = _Clock()

# A container with more items than this, or a string longer, is shown shortened.
SHOWN_WHOLE = 64


def _on_time() -> None:
    deadline = _CLOCK.deadline
    if deadline is not None and time.thread_time() > deadline:
        raise _OutOfTime


Keyword = Callable[[Any, Any, Any, Any], Iterator[Any]]


def _timed(keyword: Keyword) -> Keyword:
    def run(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        _on_time()
        return keyword(validator, value, _shown(instance), schema)

    return run


def _shown(instance: Any) -> Any:
    """``instance``, or for a large one an equal stand-in whose ``repr`` is short (made
    once per check): jsonschema puts ``instance!r`` in its messages."""
    if isinstance(instance, _Short) or not isinstance(instance, list | dict | str):
        return instance
    if len(instance) <= SHOWN_WHOLE:
        return instance
    known = _CLOCK.shown.get(id(instance))
    if known is None:
        known = _CLOCK.shown[id(instance)] = (instance, _stand_in(instance))
    return known[1]


def _stand_in(instance: list[Any] | dict[str, Any] | str) -> _Short:
    """The stand-in, filled a piece at a time: one copy of 5 million items is a C call
    that holds the GIL (30-50 ms); between pieces the event loop may take it."""
    if isinstance(instance, str):
        return _Text(instance)
    items = iter(instance.items() if isinstance(instance, dict) else instance)
    stand_in: _Array | _Object = _Object() if isinstance(instance, dict) else _Array()
    while piece := list(islice(items, PIECE)):
        if isinstance(stand_in, _Object):
            stand_in.update(piece)
        else:
            stand_in.extend(piece)
    return stand_in


class _Short:
    """A stand-in that shows itself shortened."""

    __slots__ = ()

    def __repr__(self) -> str:
        return _short(self, 0)


class _Array(_Short, list):  # type: ignore[type-arg]
    __slots__ = ()


class _Object(_Short, dict):  # type: ignore[type-arg]
    __slots__ = ()


class _Text(_Short, str):
    __slots__ = ()


def _short(value: Any, level: int) -> str:
    if isinstance(value, str):
        text = str.__str__(value)
        return repr(text) if len(text) <= SHOWN_WHOLE else repr(text[:SHOWN_WHOLE]) + "…"
    if isinstance(value, list):
        if level >= 2:
            return "[…]" if value else "[]"
        shown = [_short(item, level + 1) for item in value[:5]]
        more = f", … ({len(value)} items)" if len(value) > 5 else ""
        return "[" + ", ".join(shown) + more + "]"
    if isinstance(value, dict):
        if level >= 2:
            return "{…}" if value else "{}"
        pairs = [
            f"{_short(key, level + 1)}: {_short(item, level + 1)}"
            for key, item in islice(value.items(), 5)
        ]
        more = f", … ({len(value)} keys)" if len(value) > 5 else ""
        return "{" + ", ".join(pairs) + more + "}"
    return repr(value)


def _unique_items(small: Keyword) -> Keyword:
    """``uniqueItems`` as jsonschema checks it for a short array; a long one by hashing
    each item (jsonschema sorts the array, one C call over all of it, or compares every
    pair). Items that are arrays or objects compare by their JSON with sorted keys
    (1 and 1.0 inside them differ, as they do not at the top)."""

    def check(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if not (unique and validator.is_type(instance, "array")):
            return
        if len(instance) <= SHOWN_WHOLE:
            yield from small(validator, unique, instance, schema)
            return
        seen: set[Any] = set()
        for index, item in enumerate(instance):
            if index % 1024 == 0:
                _on_time()
            key = _identity(item)
            if key in seen:
                yield ValidationError(f"{instance!r} has non-unique elements")
                return
            seen.add(key)

    return check


def _identity(item: Any) -> Any:
    if isinstance(item, bool) or item is None:
        return ("b", item)
    if isinstance(item, int | float):
        return ("n", item)  # 1 == 1.0, with the same hash
    if isinstance(item, str):
        return ("s", str.__str__(item))
    return ("j", orjson.dumps(item, option=orjson.OPT_SORT_KEYS))


def _walk(value: Any) -> Iterator[dict[str, Any]]:
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            yield current
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)


def _has_inner_id(schema: dict[str, Any]) -> bool:
    return any("$id" in node or "id" in node for node in _walk(schema) if node is not schema)


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
