"""``generate``: streams ``config.text`` word by word, the offline stand-in for a model."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import Field, field_validator

from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType, as_text

_WORD = re.compile(r"\s*\S+\s*")
# At full speed, hand the loop back this often so other executions are not starved.
_YIELD_EVERY = 256


def split_words(text: str) -> list[str]:
    """One word plus its following whitespace per chunk; the chunks join to ``text``."""
    chunks = _WORD.findall(text)
    if not chunks and text:
        return [text]
    return chunks


class GenerateConfig(BlockConfig):
    text: str
    tokens_per_second: float = Field(0, ge=0)

    _text_as_str = field_validator("text", mode="before")(as_text)


class Generate(BlockType[GenerateConfig]):
    """Emits the text as chunks at ``tokensPerSecond`` (0 = as fast as possible)."""

    name = "generate"
    config_model = GenerateConfig

    async def run(self, ctx: BlockContext, config: GenerateConfig) -> Any:
        loop = asyncio.get_running_loop()
        rate = config.tokens_per_second
        start = loop.time()
        for index, chunk in enumerate(split_words(config.text)):
            if rate > 0:
                # An absolute schedule: a late chunk does not push every later one back.
                delay = start + index / rate - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            elif index % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
            ctx.emit_chunk(chunk)
        return {"text": config.text}
