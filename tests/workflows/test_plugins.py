from __future__ import annotations

from typing import Any

import pytest

from lib.errors import FlowcastError
from lib.workflows.blocks import BlockContext
from lib.workflows.plugins import MARK, PluginError, block, load_plugins

from .conftest import RunWorkflow, workflow

PACKAGE = f"{__package__}." if __package__ else ""
SAMPLE = PACKAGE + "sample_plugins"


def test_load_plugins_collects_marked_handlers() -> None:
    handlers = load_plugins([SAMPLE])
    assert sorted(handlers) == ["double", "greet"]


def test_loading_the_same_module_twice_is_not_a_clash() -> None:
    assert sorted(load_plugins([SAMPLE, f" {SAMPLE} ", ""])) == ["double", "greet"]


def test_duplicate_plugin_names_are_refused() -> None:
    with pytest.raises(PluginError, match="'greet' is defined in both"):
        load_plugins([SAMPLE, PACKAGE + "clashing_plugins"])


@pytest.mark.parametrize("module", ["broken_plugins", "no_such_plugin_module"])
def test_import_errors_are_plugin_errors(module: str) -> None:
    with pytest.raises(PluginError, match="cannot import plugin module") as caught:
        load_plugins([PACKAGE + module])
    assert isinstance(caught.value, FlowcastError)


def test_block_decorator_only_marks_the_function() -> None:
    async def handler(ctx: BlockContext, args: Any) -> Any:
        return None

    assert block("x")(handler) is handler
    assert getattr(handler, MARK) == "x"


def test_block_decorator_refuses_sync_functions() -> None:
    def handler(ctx: BlockContext, args: Any) -> Any:
        return None

    with pytest.raises(TypeError):
        block("x")(handler)


async def test_loaded_plugin_runs_as_a_python_block(run_workflow: RunWorkflow) -> None:
    definition = workflow(
        [
            {
                "id": "hi",
                "type": "python",
                "config": {"name": "greet", "args": {"name": "{{ input }}"}},
            },
            {"id": "twice", "type": "python", "config": {"name": "double", "args": {"n": 21}}},
        ]
    )
    output, recorder = await run_workflow(definition, input="Ada", plugins=load_plugins([SAMPLE]))
    assert output == {"hi": {"greeting": "hello Ada", "block": "hi"}, "twice": 42}
    assert [c["text"] for c in recorder.of("block:chunk", "hi")] == ["hello ", "Ada"]
