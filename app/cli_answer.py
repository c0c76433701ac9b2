"""The answer ``flowcast approve`` and ``flowcast reject`` send to a pause, built from its
JSON Schema the way the page builds its form.

A boolean ``approved`` property (or a pause without a schema) is the decision: ``true``
for approve, ``false`` for reject. Every other property of a simple object schema
(boolean, string, number, integer, or an enum of those) is a field: given with
``--set NAME=VALUE`` (``--note TEXT`` for ``note``), else asked at a terminal, else
its ``default``; a required field left without a value is refused before anything is
sent. Any other schema takes the answer as JSON (``--input``, or asked at a terminal).
The server checks the answer against the schema in the end (422 with its message).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SCALARS = {"boolean", "string", "number", "integer"}
YES, NO = {"y", "yes", "true", "1"}, {"n", "no", "false", "0"}

# Reads one line the person typed after the question it is given (EOFError at the end).
Ask = Callable[[str], str]


class NoAnswer(ValueError):
    """The answer cannot be built (the message says what to give); nothing was sent."""


@dataclass(frozen=True)
class Field:
    name: str
    schema: dict[str, Any]
    required: bool

    @property
    def title(self) -> str:
        return str(self.schema.get("title") or self.name)

    def question(self) -> str:
        """``note (string, optional): ``, ``level [low/high] (default low): ``, …"""
        kind = self.schema.get("type", "")
        if "enum" in self.schema:
            kind = "/".join(_text(value) for value in self.schema["enum"])
            shown = f"{self.title} [{kind}]"
        elif kind == "boolean":
            shown = f"{self.title} [y/n]"
        else:
            shown = f"{self.title} ({kind})"
        if "default" in self.schema:
            shown += f" (default {_text(self.schema['default'])})"
        elif not self.required:
            shown += " (optional, Enter to skip)"
        if self.schema.get("description"):
            shown += f" — {self.schema['description']}"
        return shown + ": "

    def parse(self, raw: str) -> Any:
        """The value typed for this field; ValueError saying what is expected."""
        if "enum" in self.schema:
            for value in self.schema["enum"]:
                if raw == _text(value):
                    return value
            choices = ", ".join(_text(value) for value in self.schema["enum"])
            raise ValueError(f"{self.name} must be one of: {choices}")
        match self.schema.get("type"):
            case "boolean":
                if raw.lower() in YES | NO:
                    return raw.lower() in YES
                raise ValueError(f"{self.name} is yes or no")
            case "integer":
                try:
                    return int(raw)
                except ValueError:
                    raise ValueError(f"{self.name} must be a whole number") from None
            case "number":
                try:
                    number = float(raw)
                except ValueError:
                    raise ValueError(f"{self.name} must be a number") from None
                return int(number) if number.is_integer() and "." not in raw else number
        return raw


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return value if isinstance(value, str) else json.dumps(value)


def _is_field(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if isinstance(schema.get("enum"), list):
        return all(isinstance(value, str | int | float | bool) for value in schema["enum"])
    return schema.get("type") in SCALARS


def fields(schema: Any) -> list[Field] | None:
    """The fields of a simple object schema, in order; None for any other schema."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return None
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not all(map(_is_field, properties.values())):
        return None
    required = set(schema.get("required") or [])
    return [Field(name, prop, name in required) for name, prop in properties.items()]


def decides(schema: Any) -> bool:
    """Whether ``approved`` carries the decision: a boolean property, or no schema."""
    if not schema:
        return True
    properties = schema.get("properties") if isinstance(schema, dict) else None
    approved = properties.get("approved") if isinstance(properties, dict) else None
    return isinstance(approved, dict) and approved.get("type") == "boolean"


def build(
    schema: Any,
    *,
    approved: bool,
    given: Any = None,
    settings: list[str] | None = None,
    note: str | None = None,
    ask: Ask | None = None,
) -> Any:
    """The answer to send: ``given`` (``--input``), the ``NAME=VALUE`` ``settings``, the
    note and the decision, then each field still missing asked with ``ask`` (None: not
    at a terminal, so defaults or a refusal)."""
    if not approved and not decides(schema):
        raise NoAnswer("this pause has no boolean 'approved' to answer no with")
    form = fields(schema)
    if given is None and form is None and not decides(schema):
        if ask is None:
            raise NoAnswer("this pause's schema takes its answer as JSON: give it with --input")
        given = _ask_json(ask)
    answer = given if given is not None else {}
    extra = bool(settings) or note is not None or decides(schema)
    if extra and not isinstance(answer, dict):
        raise NoAnswer("--input must be a JSON object to add a decision, --set or --note to")
    by_name = {field.name: field for field in form or []}
    for setting in settings or []:
        name, sep, raw = setting.partition("=")
        if not sep or not name:
            raise NoAnswer(f"--set takes NAME=VALUE, got {setting!r}")
        field = by_name.get(name)
        try:
            answer[name] = field.parse(raw) if field else raw
        except ValueError as exc:
            raise NoAnswer(str(exc)) from None
    if note is not None:
        answer["note"] = note
    if decides(schema):  # first, as a person reads it; whatever --set or --input said
        answer = {"approved": approved, **{k: v for k, v in answer.items() if k != "approved"}}
    for field in form or []:
        if field.name in answer or field.name == "approved":
            continue
        value = _ask_field(field, ask) if ask else field.schema.get("default", _MISSING)
        if value is not _MISSING:
            answer[field.name] = value
        elif field.required and ask is None:
            raise NoAnswer(
                f"{field.name!r} is required: give it with --set {field.name}=VALUE"
                " (or answer at a terminal)"
            )
    return answer


_MISSING = object()


def _ask_field(field: Field, ask: Ask) -> Any:
    while True:
        raw = ask(field.question()).strip()
        if not raw:
            if "default" in field.schema:
                return field.schema["default"]
            if not field.required:
                return _MISSING
            _say(f"{field.name} is required")
            continue
        try:
            return field.parse(raw)
        except ValueError as exc:
            _say(str(exc))


def _ask_json(ask: Ask) -> Any:
    while True:
        try:
            return json.loads(ask("answer (JSON): "))
        except ValueError as exc:
            _say(f"not valid JSON: {exc}")


def _say(text: str) -> None:
    print(f"flowcast: {text}", file=sys.stderr, flush=True)


def terminal_ask(question: str) -> str:
    """Ask on stderr (stdout stays the command's result) and read a line from stdin."""
    sys.stderr.write(question)
    sys.stderr.flush()
    return input()
