"""Plugin blocks: ``@block("name")`` marks an async handler; ``load_plugins`` collects them.

Marking only sets an attribute, so importing a plugin module registers nothing globally;
each server builds its own handler map from the modules it is configured with.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from lib.errors import FlowcastError
from lib.workflows.blocks.base import PluginHandler

MARK = "__flowcast_block__"

F = TypeVar("F", bound=Callable[..., Any])


class PluginError(FlowcastError):
    """A plugin module could not be loaded, or two handlers claim the same name."""

    code = "plugin_error"

    def __init__(self, message: str, *, module: str) -> None:
        super().__init__(message)
        self.module = module


def block(name: str) -> Callable[[F], F]:
    """Mark ``async def handler(ctx, args)`` as the plugin block ``name``.

    ``ctx`` is the attempt's ``BlockContext``: ``emit_chunk`` streams text,
    ``request_approval`` pauses for a human, ``attempt`` counts the runs of this block
    (retries and re-runs after a recovery) and ``idempotency_key`` is the same on all of
    them; handlers run at least once, so pass the key along with any side effect.
    ``args`` is the block's rendered ``config.args``; the return value is its output.
    """
    if not name or not isinstance(name, str):
        raise ValueError("a plugin block needs a non-empty name")

    def mark(handler: F) -> F:
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(f"plugin block {name!r} must be an async function")
        setattr(handler, MARK, name)
        return handler

    return mark


def load_plugins(modules: Iterable[str]) -> dict[str, PluginHandler]:
    """Import each module and collect its marked handlers, by block name."""
    handlers: dict[str, PluginHandler] = {}
    origins: dict[str, str] = {}
    for raw_name in modules:
        module_name = raw_name.strip()
        if not module_name:
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise PluginError(
                f"cannot import plugin module {module_name!r}: {type(exc).__name__}: {exc}",
                module=module_name,
            ) from exc
        for value in vars(module).values():
            name = getattr(value, MARK, None)
            if not isinstance(name, str) or not callable(value):
                continue
            if name in handlers and handlers[name] is not value:
                raise PluginError(
                    f"plugin block {name!r} is defined in both {origins[name]!r} "
                    f"and {module_name!r}",
                    module=module_name,
                )
            handlers[name] = value
            origins.setdefault(name, module_name)
    return handlers
