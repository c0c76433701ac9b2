"""Jinja templates in block configs and edge conditions, evaluated in a sandbox.

A string that is exactly one ``{{ expr }}`` evaluates to the expression's native value
(``"{{ input }}"`` is the input object itself); any other string with ``{{`` or ``{%``
renders to a string. Output is bounded: rendering stops as soon as it passes
``max_output_bytes``, and ``*``/``**`` are intercepted so one expression cannot build a
huge string, list or integer before the bound is checked. Time is bounded too: every
call, attribute and item access checks a deadline of ``max_render_seconds``, so nested
loops that print nothing still stop (loops run over ``range`` or data, and each inner
loop starts with a call or an access).

These bounds are cooperative: a loop over a literal list, or one allocation that is
already too big, escapes them. ``Templates`` is therefore the evaluator *inside* the
workers of ``lib.workflows.pool``, which add hard OS limits; only ``lookup`` (a plain
``{{ input.a[0] }}`` path over JSON data, which cannot loop or allocate) runs in the
server's own process.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.environment import TemplateExpression
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lib.errors import BlockError

_SINGLE_EXPRESSION = re.compile(r"^\s*\{\{((?:(?!\{\{|\}\}|\{%|\{#).)*)\}\}\s*$", re.DOTALL)
_MARKERS = ("{{", "{%", "{#")
_CACHE_LIMIT = 4096
_MAX_EXPONENT = 1024
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_template(value: Any) -> bool:
    """Whether a config value is a string holding template syntax."""
    return isinstance(value, str) and any(marker in value for marker in _MARKERS)


class _NotSimple(Exception):
    """The expression is not a plain path, or walking it would need Jinja's rules."""


NOT_SIMPLE: Any = object()
"""What ``lookup`` returns for anything but a plain path it can answer exactly."""

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_STEP = re.compile(rf"""\s*(?:\.({_NAME})|\[\s*(?:(\d+)|'([^'\\]*)'|"([^"\\]*)")\s*\])""")
_ROOT = re.compile(r"\s*(input|blocks)\b")
_BRACES = re.compile(r"^\s*\{\{(.*)\}\}\s*$", re.DOTALL)


def _path(expr: str) -> tuple[str, list[str | int]] | None:
    """``input.a['b'][0]`` as ("input", ["a", "b", 0]); None for anything else."""
    root = _ROOT.match(expr)
    if root is None:
        return None
    steps: list[str | int] = []
    position = root.end()
    while position < len(expr):
        step = _STEP.match(expr, position)
        if step is None:
            return None if expr[position:].strip() else (root.group(1), steps)
        name, index, single, double = step.groups()
        if name is not None:
            steps.append("." + name)
        elif index is not None:
            steps.append(int(index))
        else:
            steps.append(single if single is not None else double)
        position = step.end()
    return root.group(1), steps


def _step(value: Any, step: str | int) -> Any:
    """One lookup with Jinja's result on JSON data; raise _NotSimple where it differs."""
    dotted = isinstance(step, str) and step.startswith(".")
    key: str | int = step[1:] if isinstance(step, str) and dotted else step
    if isinstance(value, dict) and not dotted and key in value:
        return value[key]  # an item before an attribute, as Jinja's subscript does
    if isinstance(key, str) and hasattr(value, key):
        raise _NotSimple  # Jinja would find a method (``input.items``): let it decide
    if isinstance(value, dict) and isinstance(key, str):
        return value.get(key, jinja2.Undefined())
    if isinstance(value, list) and isinstance(key, int):
        return value[key] if key < len(value) else jinja2.Undefined()
    if isinstance(value, dict | list):
        return jinja2.Undefined()
    raise _NotSimple


def lookup(expr: str, context: dict[str, Any], *, braces: bool, plain: bool = True) -> Any:
    """A plain path's value (``input.a``, ``blocks.x.output['k'][0]``), or NOT_SIMPLE.

    With ``braces`` the source must be exactly ``{{ path }}``. Only dict and list lookups
    are answered here, with the same result the sandbox gives (missing is None); those
    cannot loop or allocate, so they are safe on the event loop. Without ``plain`` the
    value is the context's own, not yet made plain data (``plain_value``): a caller that
    bounds its size checks it first, as making a large value plain walks all of it.
    """
    if braces:
        match = _BRACES.match(expr)
        if match is None or _MARKERS_INSIDE.search(match.group(1)):
            return NOT_SIMPLE
        expr = match.group(1)
    parsed = _path(expr)
    if parsed is None or parsed[0] not in context:
        return NOT_SIMPLE
    value = context[parsed[0]]
    try:
        for step in parsed[1]:
            if isinstance(value, jinja2.Undefined):
                break
            value = _step(value, step)
    except _NotSimple:
        return NOT_SIMPLE
    return _plain(value) if plain else value


def plain_value(value: Any) -> Any:
    """What ``lookup`` gives for a value it found (``plain=False``)."""
    return _plain(value)


_MARKERS_INSIDE = re.compile(r"\{\{|\}\}|\{%|\{#")


def _key_path(key: str) -> str:
    return f".{key}" if _IDENTIFIER.match(key) else f"[{key!r}]"


# The widths and precisions in a printf-style format string ("%0200000000d", "%.9s").
_FORMAT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")


class _Missing(jinja2.ChainableUndefined):
    """A name or key that is not there: null as a whole value, empty inside text, false
    as a condition; computing with it or comparing it fails, and says how to fix that
    (Jinja's own words were "'dict object' has no attribute 'amount'", issue 26)."""

    __slots__ = ()

    @property
    def _undefined_message(self) -> str:
        name = self._undefined_name
        if self._undefined_hint:
            return self._undefined_hint
        if self._undefined_obj is jinja2.utils.missing:
            what = f"{name!r} is undefined"
        elif isinstance(self._undefined_obj, dict):
            what = f"the key {name!r} is missing"
        else:
            what = f"{jinja2.utils.object_type_repr(self._undefined_obj)} has no {name!r}"
        return (
            f"{what}: a missing value cannot be computed with or compared; "
            "give it a fallback with default(…), or test it with `is defined`"
        )


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with explicit refusals and bounded ``*`` and ``**``."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, *, max_output_bytes: int) -> None:
        # No optimizer: it folds constant expressions while compiling, so storing a
        # workflow would evaluate tenant data ("{{ '%0200000000d' % 1 }}" built 200 MB).
        super().__init__(autoescape=False, undefined=_Missing, optimized=False)
        self.max_output_bytes = max_output_bytes
        self.deadline = float("inf")

    def _on_time(self) -> None:
        # CPU time, as the bound is stated: a busy machine slows a template down without
        # making it fail.
        if time.process_time() > self.deadline:
            raise SecurityError("the template took too long to render")

    def call(self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        self._on_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._on_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._on_time()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # The default returns an undefined that renders as "", hiding the refusal.
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed"
        )

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    if len(seq) * times > self.max_output_bytes:
                        raise SecurityError("the repeated value would be too large")
            return left * right
        if operator == "%" and isinstance(left, str):
            # printf-style formatting: refuse widths and precisions past the output cap
            # before Python builds the string.
            for width, precision in _FORMAT_SPEC.findall(left):
                if max(int(width or 0), int(precision or 0)) > self.max_output_bytes:
                    raise SecurityError("the formatted value would be too large")
            return left % right
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right > _MAX_EXPONENT:
                    raise SecurityError("the exponent is too large")
            return left**right
        return super().call_binop(context, operator, left, right)


def _plain(value: Any) -> Any:
    """Turn what an expression returned into plain JSON-like data."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, jinja2.Undefined):
        return None
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | range):
        return [_plain(item) for item in value]
    return str(value)


class Templates:
    """Renders templated JSON values and evaluates edge conditions in a sandbox."""

    def __init__(
        self, *, max_output_bytes: int = 1024 * 1024, max_render_seconds: float = 1.0
    ) -> None:
        self.max_output_bytes = max_output_bytes
        self.max_render_seconds = max_render_seconds
        self._env = _Sandbox(max_output_bytes=max_output_bytes)
        self._templates: dict[str, jinja2.Template] = {}
        self._expressions: dict[str, TemplateExpression] = {}

    def render(self, value: Any, context: dict[str, Any]) -> Any:
        """Render every template inside a JSON value; other values come back unchanged."""
        if isinstance(value, str):
            return self._render_string(value, context) if is_template(value) else value
        if isinstance(value, dict):
            return {key: self.render(item, context) for key, item in value.items()}
        if isinstance(value, list):
            return [self.render(item, context) for item in value]
        return value

    def condition(self, expr: str, context: dict[str, Any]) -> bool:
        """Evaluate an edge's ``when`` expression; undefined is false."""
        result = self._evaluate(expr, context)
        return result is not None and bool(result)

    def check(self, value: Any, blocks: Collection[str] | None = None) -> list[tuple[str, str]]:
        """Every unparsable template inside a JSON value, and every read of a block not
        in ``blocks`` (when given), as (path suffix, message)."""
        problems: list[tuple[str, str]] = []
        if isinstance(value, str):
            if is_template(value):
                message = self._syntax_problem(value, blocks)
                if message:
                    problems.append(("", message))
        elif isinstance(value, dict):
            for key, item in value.items():
                problems += [(_key_path(str(key)) + p, m) for p, m in self.check(item, blocks)]
        elif isinstance(value, list):
            for index, item in enumerate(value):
                problems += [(f"[{index}]{p}", m) for p, m in self.check(item, blocks)]
        return problems

    def check_expression(self, expr: str, blocks: Collection[str] | None = None) -> str | None:
        """Why a bare expression (an edge's ``when``) cannot be parsed, or reads a block
        not in ``blocks`` (when given); None when it is fine."""
        try:
            with _bounded_nesting():
                parser = Parser(self._env, expr, state="variable")
                tree = parser.parse_expression()
                if not parser.stream.eos:
                    raise TemplateSyntaxError("chunk after expression", 1)
                self._check_names(tree)
        except TemplateSyntaxError as exc:
            return f"unparsable expression: {exc.message}"
        return None if blocks is None else _unknown_block(tree, blocks)

    def secret_reads(self, value: Any) -> tuple[set[str], list[tuple[str, str]]]:
        """The secret names a config's templates read, and any read not by plain name.

        ``secrets`` may only be read as ``secrets.NAME`` or ``secrets['NAME']``, so the
        server knows which values a block needs (and loads no others); anything else
        (``secrets | list``, ``secrets[input.k]``, a loop over it) is a problem.
        """
        names: set[str] = set()
        problems: list[tuple[str, str]] = []
        for path, source in _template_paths(value, ""):
            try:
                with _bounded_nesting():
                    found, bad = _secret_names(self._env.parse(source))
            except TemplateSyntaxError:
                continue  # reported by ``check``
            names |= found
            if bad:
                problems.append((path, "read a secret by its name only: {{ secrets.NAME }}"))
        return names, problems

    def expression_reads_secrets(self, expr: str) -> bool:
        """Whether a bare expression (an edge's ``when``) mentions ``secrets`` at all."""
        try:
            with _bounded_nesting():
                tree = self._env.parse("{{ " + expr + " }}")
                return any(node.name == "secrets" for node in tree.find_all(nodes.Name))
        except TemplateSyntaxError:
            return False

    def _syntax_problem(self, source: str, blocks: Collection[str] | None) -> str | None:
        # Parsed, never compiled: Jinja's code generator evaluates constant output
        # while compiling ("{{ '%200000002s'|format(1) }}" built 200 MB), and storing a
        # workflow evaluates nothing (SPEC §8). What compiling would also refuse, an
        # unknown filter or test, is looked up here.
        try:
            with _bounded_nesting():
                tree = self._env.parse(source)
                self._check_names(tree)
        except TemplateSyntaxError as exc:
            return f"unparsable template: {exc.message}"
        return None if blocks is None else _unknown_block(tree, blocks)

    def _check_names(self, tree: nodes.Node) -> None:
        for node in (tree, *tree.find_all((nodes.Filter, nodes.Test))):
            if not isinstance(node, nodes.Filter | nodes.Test):
                continue
            known = self._env.filters if isinstance(node, nodes.Filter) else self._env.tests
            if node.name not in known:
                kind = "filter" if isinstance(node, nodes.Filter) else "test"
                raise TemplateSyntaxError(f"no {kind} named {node.name!r}", node.lineno or 1)

    def _render_string(self, source: str, context: dict[str, Any]) -> Any:
        match = _SINGLE_EXPRESSION.match(source)
        if match:
            return self._evaluate(match.group(1), context)
        return self._guard(lambda: self._render_bounded(source, context))

    def _render_bounded(self, source: str, context: dict[str, Any]) -> str:
        parts: list[str] = []
        size = 0
        for part in self._template(source).generate(context):
            self._env._on_time()
            size += len(part.encode("utf-8", "surrogatepass"))
            if size > self.max_output_bytes:
                raise BlockError(
                    "template_error",
                    f"template output exceeds {self.max_output_bytes} bytes",
                    retryable=False,
                )
            parts.append(part)
        return "".join(parts)

    def _evaluate(self, expr: str, context: dict[str, Any]) -> Any:
        def run() -> Any:
            return _plain(self._expression(expr)(**context))

        result = self._guard(run)
        if (
            isinstance(result, str)
            and len(result.encode("utf-8", "surrogatepass")) > self.max_output_bytes
        ):
            raise BlockError(
                "template_error",
                f"template output exceeds {self.max_output_bytes} bytes",
                retryable=False,
            )
        return result

    def _guard(self, render: Callable[[], Any]) -> Any:
        self._env.deadline = time.process_time() + self.max_render_seconds
        try:
            return render()
        except BlockError:
            raise
        except TemplateError as exc:
            raise BlockError("template_error", str(exc.message), retryable=False) from exc
        except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError) as exc:
            message = f"{type(exc).__name__}: {exc}"
            raise BlockError("template_error", message, retryable=False) from exc
        finally:
            self._env.deadline = float("inf")

    def _template(self, source: str) -> jinja2.Template:
        template = self._templates.get(source)
        if template is None:
            if len(self._templates) >= _CACHE_LIMIT:
                self._templates.clear()
            template = self._templates[source] = self._env.from_string(source)
        return template

    def _expression(self, expr: str) -> TemplateExpression:
        compiled = self._expressions.get(expr)
        if compiled is None:
            if len(self._expressions) >= _CACHE_LIMIT:
                self._expressions.clear()
            compiled = self._env.compile_expression(expr, undefined_to_none=True)
            self._expressions[expr] = compiled
        return compiled


@contextlib.contextmanager
def _bounded_nesting() -> Iterator[None]:
    """A template nested past Python's recursion limit (``((((…))))``, ``-----1``,
    ``{% if %}`` in ``{% if %}``…) is a syntax problem of its own, never a 500."""
    try:
        yield
    except RecursionError:
        raise TemplateSyntaxError("nested too deeply", 1) from None


def _reads_of(tree: nodes.Node, name: str) -> Iterator[tuple[nodes.Node, Any]]:
    """Each ``<name>.key`` and ``<name>['key']`` in a parsed template, with its key (a
    constant subscript's value; None for any other subscript)."""
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        target = getattr(node, "node", None)
        if not (isinstance(target, nodes.Name) and target.name == name):
            continue
        if isinstance(node, nodes.Getattr):
            yield node, node.attr
        else:
            arg = getattr(node, "arg", None)
            yield node, arg.value if isinstance(arg, nodes.Const) else None


def _unknown_block(tree: nodes.Node, blocks: Collection[str]) -> str | None:
    """The first ``blocks.<id>`` (``blocks['<id>']``) in a parsed template whose id is
    no block of the workflow, as a problem; None when there is none.

    A static walk of the parsed tree (storing a workflow evaluates nothing, SPEC §8),
    as long as the tree: templates are at most 64 KiB. Such a read is always null at
    run time, so ``when: "blocks.zzz.output"`` skipped its block without a word (issue
    26). A template that assigns ``blocks`` itself is left alone; so is a dict method
    (``blocks.items()``), which Jinja finds before a block of that name."""
    stores = (node for node in tree.find_all(nodes.Name) if node.ctx != "load")
    if any(node.name == "blocks" for node in stores):
        return None
    for node, key in _reads_of(tree, "blocks"):
        if not isinstance(key, str) or key in blocks:
            continue
        if isinstance(node, nodes.Getattr) and hasattr(dict, key):
            continue
        known = ", ".join(sorted(blocks)[:20]) + (", …" if len(blocks) > 20 else "")
        return f"unknown block {key!r} in blocks.{key} (blocks: {known})"
    return None


# `blocks.<id>` and `blocks['<id>']` in a template; any other use of `blocks` reads all.
_BLOCK_READ = re.compile(
    r"""\bblocks\s*(?:\.\s*([A-Za-z_][A-Za-z0-9_]*)|\[\s*(['"])([^'"]*)\2\s*\])"""
)
_BLOCKS_WORD = re.compile(r"\bblocks\b")


def _template_paths(value: Any, path: str) -> list[tuple[str, str]]:
    """(path suffix, source) of every template string inside a config value."""
    if isinstance(value, str):
        return [(path, value)] if is_template(value) else []
    if isinstance(value, dict):
        return [
            found
            for key, item in value.items()
            for found in (
                *_template_paths(key, path + _key_path(str(key))),
                *_template_paths(item, path + _key_path(str(key))),
            )
        ]
    if isinstance(value, list):
        return [
            found
            for index, item in enumerate(value)
            for found in _template_paths(item, f"{path}[{index}]")
        ]
    return []


@functools.cache
def _parser() -> jinja2.Environment:
    return jinja2.Environment(autoescape=False)


def secret_names(config: Any) -> set[str]:
    """The secrets a (validated) config's templates read by name; parsing only."""
    names: set[str] = set()
    for _, source in _template_paths(config, ""):
        if "secrets" in source:
            names |= _names_in(source)
    return names


@functools.lru_cache(maxsize=1024)
def _names_in(source: str) -> frozenset[str]:
    """The names ``source`` reads, parsed once: every run works out which secrets its
    blocks read, on the event loop, and 64 templates parsed again cost ~25 ms of CPU."""
    with _bounded_nesting():
        return frozenset(_secret_names(_parser().parse(source))[0])


def _secret_names(tree: nodes.Template) -> tuple[set[str], bool]:
    """Names read as ``secrets.NAME``/``secrets['NAME']``, and whether any other use exists."""
    names: set[str] = set()
    plain = 0
    for _node, key in _reads_of(tree, "secrets"):
        if isinstance(key, str) and _IDENTIFIER.match(key) and len(key) <= 64:
            names.add(key)
            plain += 1
    uses = sum(1 for node in tree.find_all(nodes.Name) if node.name == "secrets")
    return names, uses != plain


def template_strings(value: Any) -> list[str]:
    """Every string in a config (keys too): where its templates are."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [
            text
            for key, item in value.items()
            for text in (*template_strings(key), *template_strings(item))
        ]
    if isinstance(value, list):
        return [text for item in value for text in template_strings(item)]
    return []


def block_reads(texts: list[str]) -> set[str] | None:
    """The block ids whose outputs these templates read; None when they may read any."""
    reads: set[str] = set()
    for text in texts:
        found = list(_BLOCK_READ.finditer(text))
        if len(found) != len(_BLOCKS_WORD.findall(text)):
            return None
        reads.update(match.group(1) or match.group(3) for match in found)
    return reads
