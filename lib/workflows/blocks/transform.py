"""``transform``: the rendered ``config.value``."""

from __future__ import annotations

from typing import Any

from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType


class TransformConfig(BlockConfig):
    value: Any = None


class Transform(BlockType[TransformConfig]):
    """Returns its config's ``value``; the executor has already rendered its templates."""

    name = "transform"
    config_model = TransformConfig

    async def run(self, ctx: BlockContext, config: TransformConfig) -> Any:
        return config.value
