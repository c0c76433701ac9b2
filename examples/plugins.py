"""Plugin blocks for the examples in docs/workflows.md.

Load them with ``FLOWCAST_PLUGINS=examples.plugins`` and the repository's root on the
import path (``PYTHONPATH=.`` for ``flowcast serve``; ``uvicorn`` adds its working
directory itself). A workflow calls one as ``{"type": "python", "config": {"name":
"shout", "args": {...}}}``: ``args`` is rendered like any config, and what the handler
returns is the block's output.
"""

from __future__ import annotations

from typing import Any

from lib.errors import BlockError
from lib.workflows.blocks import BlockContext
from lib.workflows.plugins import block


@block("shout")
async def shout(ctx: BlockContext, args: Any) -> Any:
    """Streams the words of ``args.text`` in capitals, one ``block:chunk`` each."""
    words = str(args.get("text", "")).split()
    for word in words:
        ctx.emit_chunk(word.upper() + " ")
    return {"text": " ".join(words).upper(), "words": len(words)}


@block("flaky")
async def flaky(ctx: BlockContext, args: Any) -> Any:
    """Fails until attempt ``args.succeedOn`` (default 2): a block to try ``retry`` on.

    ``ctx.attempt`` counts this block's runs in this execution; ``ctx.idempotency_key``
    is the same on every one of them, so a side effect sent with it can be deduplicated.
    """
    succeed_on = int(args.get("succeedOn", 2))
    if ctx.attempt < succeed_on:
        raise BlockError("not_yet", f"attempt {ctx.attempt} fails on purpose", retryable=True)
    return {"attempt": ctx.attempt, "idempotencyKey": ctx.idempotency_key}
