"""``delay``: waits ``config.ms`` milliseconds."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType


class DelayConfig(BlockConfig):
    ms: int = Field(ge=0, le=86_400_000)


class Delay(BlockType[DelayConfig]):
    """Sleeps, then reports how long it was asked to wait."""

    name = "delay"
    config_model = DelayConfig

    async def run(self, ctx: BlockContext, config: DelayConfig) -> Any:
        await asyncio.sleep(config.ms / 1000)
        return {"waitedMs": config.ms}
