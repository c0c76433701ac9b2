from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from lib.workflows.blocks.file import file_content
from lib.workflows.blocks.generate import split_words
from lib.workflows.executor import BlockFailed

from .conftest import RunWorkflow, workflow


@pytest.mark.parametrize(
    "text",
    ["Hello big  world\n", "  leading and trailing  ", "one", "", "   ", "tab\tsep\nnew"],
)
def test_generate_chunks_join_to_the_text(text: str) -> None:
    chunks = split_words(text)
    assert "".join(chunks) == text
    assert all(chunk.strip() for chunk in chunks) or text.isspace()


async def test_generate_streams_each_word_as_a_chunk(run_workflow: RunWorkflow) -> None:
    block = {
        "id": "g",
        "type": "generate",
        "config": {"text": "Dear {{ input.name }}, all good. ", "tokensPerSecond": 1000},
    }
    output, recorder = await run_workflow(workflow([block]), input={"name": "Ada"})
    chunks = [data["text"] for data in recorder.of("block:chunk", "g")]
    assert chunks == ["Dear ", "Ada, ", "all ", "good. "]
    assert output == {"g": {"text": "Dear Ada, all good. "}}


async def test_generate_at_full_speed_streams_many_words(run_workflow: RunWorkflow) -> None:
    text = " ".join(f"w{i}" for i in range(2000))
    block = {"id": "g", "type": "generate", "config": {"text": text}}
    output, recorder = await run_workflow(workflow([block]))
    chunks = [data["text"] for data in recorder.of("block:chunk", "g")]
    assert len(chunks) == 2000
    assert "".join(chunks) == text == output["g"]["text"]


@pytest.mark.parametrize("shape", ["string", "array", "object"])
@pytest.mark.parametrize("size", [100, 5000, 1_000_000])
async def test_payload_json_has_the_requested_size(
    run_workflow: RunWorkflow, shape: str, size: int
) -> None:
    block = {"id": "p", "type": "payload", "config": {"bytes": size, "shape": shape}}
    output, _ = await run_workflow(workflow([block]))
    value: Any = output["p"]
    assert type(value).__name__ == {"string": "str", "array": "list", "object": "dict"}[shape]
    encoded = json.dumps(value, separators=(",", ":"))
    assert abs(len(encoded) - size) <= size * 0.03


async def test_payload_is_deterministic(run_workflow: RunWorkflow) -> None:
    block = {"id": "p", "type": "payload", "config": {"bytes": 3000, "shape": "object"}}
    first, _ = await run_workflow(workflow([block]))
    second, _ = await run_workflow(workflow([block]))
    assert first == second


async def test_file_has_the_requested_size_and_metadata(run_workflow: RunWorkflow) -> None:
    block = {
        "id": "f",
        "type": "file",
        "config": {"bytes": 1000, "name": "a.txt", "mimeType": "text/plain"},
    }
    output, _ = await run_workflow(workflow([block]))
    value = output["f"]
    assert {k: v for k, v in value.items() if k != "base64"} == {
        "name": "a.txt",
        "mimeType": "text/plain",
        "size": 1000,
    }
    assert base64.b64decode(value["base64"]) == file_content(1000)


async def test_file_defaults_and_empty_file(run_workflow: RunWorkflow) -> None:
    output, _ = await run_workflow(workflow([{"id": "f", "type": "file", "config": {"bytes": 0}}]))
    assert output["f"] == {
        "name": "file.bin",
        "mimeType": "application/octet-stream",
        "size": 0,
        "base64": "",
    }


async def test_transform_returns_the_rendered_value(run_workflow: RunWorkflow) -> None:
    block = {
        "id": "t",
        "type": "transform",
        "config": {"value": {"who": "{{ input.who }}", "n": "{{ input.n * 2 }}", "k": [1]}},
    }
    output, _ = await run_workflow(workflow([block]), input={"who": "me", "n": 2})
    assert output == {"t": {"who": "me", "n": 4, "k": [1]}}


async def test_delay_reports_the_wait(run_workflow: RunWorkflow) -> None:
    output, _ = await run_workflow(workflow([{"id": "d", "type": "delay", "config": {"ms": 5}}]))
    assert output == {"d": {"waitedMs": 5}}


async def test_failing_condition_fails_the_target_block(run_workflow: RunWorkflow) -> None:
    definition = workflow(
        [{"id": "a", "type": "transform"}, {"id": "b", "type": "transform"}],
        [{"from": "a", "to": "b", "when": "1 / 0"}],
    )
    with pytest.raises(BlockFailed) as caught:
        await run_workflow(definition)
    assert (caught.value.block_id, caught.value.code) == ("b", "template_error")


async def test_generate_paces_words_at_tokens_per_second(run_workflow: RunWorkflow) -> None:
    block = {"id": "g", "type": "generate", "config": {"text": "a b c d e", "tokensPerSecond": 100}}
    loop = asyncio.get_running_loop()
    started = loop.time()
    await run_workflow(workflow([block]))
    # Five words on an absolute schedule: the last one is due 4/100 s after the first.
    assert loop.time() - started >= 0.04
