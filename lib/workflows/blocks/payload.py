"""``payload``: a deterministic value whose compact JSON is about ``config.bytes`` long."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType

MAX_BYTES = 64 * 1024 * 1024
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_PIECE = 1024  # the JSON size of one array element or object member, separator included


def filler(length: int) -> str:
    """A deterministic ASCII string of ``length`` characters (no JSON escaping needed)."""
    repeats = length // len(_ALPHABET) + 1
    return (_ALPHABET * repeats)[: max(length, 0)]


def make_payload(size: int, shape: str) -> Any:
    """A value of the given shape whose compact JSON is ``size`` bytes (or a bit more)."""
    if shape == "string":
        return filler(size - 2)  # the quotes
    count = max(1, (size - 2) // _PIECE)
    last = size - 2 - (count - 1) * _PIECE  # the rest goes into the last piece
    if shape == "array":
        # An element costs its quotes and a comma (except the last element).
        piece = filler(_PIECE - 3)
        return [*([piece] * (count - 1)), filler(last - 2)]
    # A member costs `"k0000000":` (11), the value's quotes and a comma.
    piece = filler(_PIECE - 14)
    members = {f"k{index:07d}": piece for index in range(count - 1)}
    members[f"k{count - 1:07d}"] = filler(last - 13)
    return members


class PayloadConfig(BlockConfig):
    bytes: int = Field(ge=1, le=MAX_BYTES)
    shape: Literal["string", "array", "object"] = "string"


class Payload(BlockType[PayloadConfig]):
    """Produces test data of a given size and shape."""

    name = "payload"
    config_model = PayloadConfig

    async def run(self, ctx: BlockContext, config: PayloadConfig) -> Any:
        return make_payload(config.bytes, config.shape)
