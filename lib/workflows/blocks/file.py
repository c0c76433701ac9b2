"""``file``: a file value ``{name, mimeType, size, base64}`` of deterministic content."""

from __future__ import annotations

import base64
from typing import Any

from pydantic import Field

from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType

MAX_BYTES = 64 * 1024 * 1024
_PATTERN = bytes(range(256))


def file_content(size: int) -> bytes:
    """``size`` deterministic bytes (every byte value, repeated)."""
    return (_PATTERN * (size // len(_PATTERN) + 1))[:size]


class FileConfig(BlockConfig):
    bytes: int = Field(ge=0, le=MAX_BYTES)
    name: str = Field("file.bin", min_length=1, max_length=255)
    mime_type: str = Field("application/octet-stream", min_length=1, max_length=255)


class File(BlockType[FileConfig]):
    """Produces a file value, e.g. to exercise large-value offloading."""

    name = "file"
    config_model = FileConfig

    async def run(self, ctx: BlockContext, config: FileConfig) -> Any:
        content = base64.b64encode(file_content(config.bytes)).decode("ascii")
        return {
            "name": config.name,
            "mimeType": config.mime_type,
            "size": config.bytes,
            "base64": content,
        }
