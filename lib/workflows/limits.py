"""Size limits on what callers send: nesting depth and template length.

Bodies are capped in bytes at the HTTP edge; these limits bound the shape of what is
inside, so no input makes validation, templates or the executor recurse or scan without
end.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 64
MAX_TEMPLATE_CHARS = 64 * 1024


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """True when ``value`` nests lists and objects more than ``limit`` levels deep."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        current, depth = stack.pop()
        if isinstance(current, dict):
            children: Any = current.values()
        elif isinstance(current, list):
            children = current
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def long_templates(value: Any, path: str = "") -> list[str]:
    """JSON path suffixes of template strings longer than MAX_TEMPLATE_CHARS."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        current, where = stack.pop()
        if isinstance(current, str):
            if len(current) > MAX_TEMPLATE_CHARS and ("{{" in current or "{%" in current):
                found.append(where)
        elif isinstance(current, dict):
            stack.extend((child, f"{where}.{key}") for key, child in current.items())
        elif isinstance(current, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(current))
    return sorted(found)
