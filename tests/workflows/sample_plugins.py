"""A plugin module for the plugin-loading tests."""

from __future__ import annotations

from typing import Any

from lib.workflows.blocks import BlockContext
from lib.workflows.plugins import block


@block("greet")
async def greet(ctx: BlockContext, args: Any) -> Any:
    ctx.emit_chunk("hello ")
    ctx.emit_chunk(str(args.get("name", "world")))
    return {"greeting": f"hello {args.get('name', 'world')}", "block": ctx.block_id}


@block("double")
async def double(ctx: BlockContext, args: Any) -> Any:
    return args["n"] * 2


async def not_a_block(ctx: BlockContext, args: Any) -> Any:
    return None
