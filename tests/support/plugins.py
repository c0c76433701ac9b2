"""A plugin module for tests: loaded by a server through FLOWCAST_PLUGINS."""

from __future__ import annotations

from typing import Any

from lib.workflows.blocks.base import BlockContext
from lib.workflows.plugins import block


@block("shout")
async def shout(ctx: BlockContext, args: Any) -> dict[str, Any]:
    """Streams the words of ``args.text`` in capitals, then returns them."""
    words = str(args["text"]).upper().split()
    for word in words:
        ctx.emit_chunk(word + " ")
    return {"words": len(words), "execution": ctx.execution_id}
