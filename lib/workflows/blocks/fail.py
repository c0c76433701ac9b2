"""``fail``: fails the execution with ``config.message``."""

from __future__ import annotations

from typing import NoReturn

from pydantic import field_validator

from lib.errors import BlockError
from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType, as_text


class FailConfig(BlockConfig):
    message: str = "the workflow failed on purpose"

    _message_as_str = field_validator("message", mode="before")(as_text)


class Fail(BlockType[FailConfig]):
    """Always fails, without retry."""

    name = "fail"
    config_model = FailConfig

    async def run(self, ctx: BlockContext, config: FailConfig) -> NoReturn:
        raise BlockError("block_failed", config.message, retryable=False)
