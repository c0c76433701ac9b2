from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from lib.errors import BlockError
from lib.workflows.templates import Templates

CONTEXT: dict[str, Any] = {
    "input": {"name": "Ada", "n": 3, "tags": ["a", "b"]},
    "blocks": {"fetch": {"output": {"status": 200, "ok": True}}},
}


def test_single_expression_returns_native_value(templates: Templates) -> None:
    assert templates.render("{{ input }}", CONTEXT) == CONTEXT["input"]
    assert templates.render("  {{ input.n + 1 }}  ", CONTEXT) == 4
    assert templates.render("{{ blocks.fetch.output.ok }}", CONTEXT) is True
    assert templates.render("{{ input.tags }}", CONTEXT) == ["a", "b"]


def test_undefined_single_expression_is_none(templates: Templates) -> None:
    assert templates.render("{{ blocks.missing.output.deep }}", CONTEXT) is None


def test_mixed_string_renders_to_string(templates: Templates) -> None:
    value = "Hello {{ input.name }}, status {{ blocks.fetch.output.status }}"
    assert templates.render(value, CONTEXT) == "Hello Ada, status 200"
    assert templates.render("{% for t in input.tags %}{{ t }};{% endfor %}", CONTEXT) == "a;b;"
    assert templates.render("{{ input.n }} and {{ input.n }}", CONTEXT) == "3 and 3"


def test_render_walks_json_and_leaves_plain_values(templates: Templates) -> None:
    value = {"a": ["{{ input.n }}", "plain", 5, None], "b": {"c": "x{{ input.name }}"}}
    assert templates.render(value, CONTEXT) == {"a": [3, "plain", 5, None], "b": {"c": "xAda"}}


def test_condition_is_truthiness_and_undefined_is_false(templates: Templates) -> None:
    assert templates.condition("blocks.fetch.output.status == 200", CONTEXT) is True
    assert templates.condition("input.n > 5", CONTEXT) is False
    assert templates.condition("blocks.nope.output.approved", CONTEXT) is False


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "x {{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ input.__class__ }}",
        "{{ input.tags.append(1) }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__ }}",
        "{{ joiner.__init__.__globals__['os'] }}",
        "{{ (input|attr('__class__')).__mro__ }}",
        "{{ '{0.__class__.__mro__}'.format(input) }}",
        "{{ '%s'.__mod__.__self__.__class__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ self.__init__.__globals__ }}",
        "{{ input.__getitem__.__self__ }}",
    ],
)
def test_sandbox_refuses_python_internals(templates: Templates, source: str) -> None:
    with pytest.raises(BlockError) as caught:
        templates.render(source, CONTEXT)
    assert caught.value.code == "template_error"
    assert caught.value.retryable is False


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 2000 }}",
        "{% for i in range(100) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}",
        "{{ 10 ** 100000 }}",
    ],
)
def test_output_larger_than_the_cap_is_refused(source: str) -> None:
    templates = Templates(max_output_bytes=1000)
    with pytest.raises(BlockError) as caught:
        templates.render(source, CONTEXT)
    assert caught.value.code == "template_error"


def test_render_error_is_a_template_error(templates: Templates) -> None:
    with pytest.raises(BlockError) as caught:
        templates.render("{{ 1 / 0 }}", CONTEXT)
    assert caught.value.code == "template_error"


def test_check_reports_unparsable_templates_with_paths(templates: Templates) -> None:
    value = {"ok": "{{ input }}", "bad": "{{ input", "list": ["x", "{% if %}"], "a b": "{{ }}"}
    paths = [path for path, _ in templates.check(value)]
    assert paths == [".bad", ".list[1]", "['a b']"]


def test_check_expression_reports_syntax_errors(templates: Templates) -> None:
    assert templates.check_expression("input.a == 1") is None
    message = templates.check_expression("input.a ===")
    assert message is not None and message.startswith("unparsable expression")


NESTED = {
    "parentheses": "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}",
    "lists": "{{ " + "[" * 3000 + "]" * 3000 + " }}",
    "unary minus": "{{ " + "-" * 5000 + "1 }}",
    "blocks": "{% if 1 %}" * 500 + "x" + "{% endif %}" * 500,
    "attributes": "{{ input" + ".a" * 5000 + " }}",
}


@pytest.mark.parametrize("shape", NESTED)
def test_a_template_nested_too_deeply_is_a_syntax_problem_not_a_crash(
    templates: Templates, shape: str
) -> None:
    """Step 16's hostile-tenant review (row 11): five shapes of deep nesting made storing
    a workflow answer 500 (a RecursionError) and drop the connection."""
    source = NESTED[shape]
    assert templates.check({"v": source}) == [(".v", "unparsable template: nested too deeply")]
    assert templates.secret_reads({"v": source}) == (set(), [])
    if shape != "blocks":
        expression = source.removeprefix("{{ ").removesuffix(" }}")
        assert templates.check_expression(expression) == "unparsable expression: nested too deeply"


def test_checking_a_template_evaluates_nothing(templates: Templates) -> None:
    """Step 16's review (row 14): Jinja's code generator evaluates constant output while
    compiling, so checking ``x{{ '%200000002s'|format(1) }}`` built 200 MB; a check
    parses only, and an unknown filter or test is still refused as compiling would."""
    for source in ("x{{ '%200000002s'|format(1) }}", "{{ ('x' * 9) ~ ('%09999999d'|format(1)) }}"):
        with memory_held_under(20 * 1024 * 1024):
            assert templates.check({"v": source}) == []
    assert templates.check({"v": "{{ x|nosuch }}"}) == [
        (".v", "unparsable template: no filter named 'nosuch'")
    ]
    assert (
        templates.check_expression("x is nosuch") == "unparsable expression: no test named 'nosuch'"
    )
    assert templates.check_expression("x|upper is defined") is None


@contextlib.contextmanager
def memory_held_under(limit: int) -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        assert tracemalloc.get_traced_memory()[1] < limit
    finally:
        tracemalloc.stop()


def test_compiled_templates_are_cached(templates: Templates) -> None:
    templates.render("a {{ input.n }}", CONTEXT)
    compiled = templates._templates["a {{ input.n }}"]
    templates.render("a {{ input.n }}", CONTEXT)
    assert templates._templates["a {{ input.n }}"] is compiled


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}",
    ],
)
def test_rendering_that_takes_too_long_is_stopped(source: str) -> None:
    templates = Templates(max_render_seconds=0.2)
    with pytest.raises(BlockError) as caught:
        templates.render(source, CONTEXT)
    assert caught.value.code == "template_error"
    assert "too long" in caught.value.message
