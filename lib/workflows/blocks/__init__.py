"""Block types: the built-ins and the registry the validator and executor share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lib.workflows.blocks.approval import Approval
from lib.workflows.blocks.base import (
    BlockConfig,
    BlockContext,
    BlockServices,
    BlockType,
    PluginHandler,
)
from lib.workflows.blocks.delay import Delay
from lib.workflows.blocks.fail import Fail
from lib.workflows.blocks.file import File
from lib.workflows.blocks.generate import Generate
from lib.workflows.blocks.http import Http
from lib.workflows.blocks.llm import Llm
from lib.workflows.blocks.payload import Payload
from lib.workflows.blocks.python import Python
from lib.workflows.blocks.transform import Transform

__all__ = [
    "BlockConfig",
    "BlockContext",
    "BlockServices",
    "BlockType",
    "BlockTypes",
    "PluginHandler",
]


class BlockTypes:
    """The block types one server knows, by name."""

    def __init__(self, types: Iterable[BlockType[Any]]) -> None:
        self._types: dict[str, BlockType[Any]] = {}
        for block_type in types:
            if block_type.name in self._types:
                raise ValueError(f"block type {block_type.name!r} is registered twice")
            self._types[block_type.name] = block_type

    @classmethod
    def builtin(cls, plugins: Mapping[str, PluginHandler] | None = None) -> BlockTypes:
        """The built-in types, with ``python`` bound to these plugin handlers."""
        return cls(
            [
                Transform(),
                Delay(),
                Generate(),
                Http(),
                Llm(),
                Payload(),
                File(),
                Fail(),
                Approval(),
                Python(plugins or {}),
            ]
        )

    def get(self, name: str) -> BlockType[Any] | None:
        """The type with this name, or None."""
        return self._types.get(name)

    def names(self) -> list[str]:
        """Every registered type name, sorted."""
        return sorted(self._types)

    def secret_readers(self) -> list[str]:
        """The types whose templates may read ``{{ secrets.NAME }}``, sorted."""
        return [name for name in self.names() if self._types[name].reads_secrets]

    def __contains__(self, name: object) -> bool:
        return name in self._types
