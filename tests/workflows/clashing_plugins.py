"""A plugin module that claims a name sample_plugins already uses."""

from __future__ import annotations

from typing import Any

from lib.workflows.blocks import BlockContext
from lib.workflows.plugins import block


@block("greet")
async def greet_again(ctx: BlockContext, args: Any) -> Any:
    return "hi"
