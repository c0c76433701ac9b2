"""``python``: calls a plugin handler registered with ``@block(name)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from lib.errors import BlockError
from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType, PluginHandler


class PythonConfig(BlockConfig):
    name: str
    args: Any = Field(default_factory=dict)


class Python(BlockType[PythonConfig]):
    """Runs the plugin named in the config with the rendered ``args``."""

    name = "python"
    config_model = PythonConfig

    def __init__(self, plugins: Mapping[str, PluginHandler]) -> None:
        self.plugins = dict(plugins)

    def check_raw(self, raw: dict[str, Any]) -> list[tuple[str, str]]:
        name = raw.get("name")
        if isinstance(name, str) and name not in self.plugins:
            return [(".name", self._unknown(name))]
        return []

    async def run(self, ctx: BlockContext, config: PythonConfig) -> Any:
        handler = self.plugins.get(config.name)
        if handler is None:
            raise BlockError("unknown_plugin", self._unknown(config.name), retryable=False)
        return await handler(ctx, config.args)

    def _unknown(self, name: str) -> str:
        known = ", ".join(sorted(self.plugins)) or "none"
        return f"unknown plugin block {name!r} (registered: {known})"
