"""What every script shares: the prelude ``register`` puts in front of it, names that
only come in as arguments, and a header that names every KEYS and ARGV it reads."""

from __future__ import annotations

import re

import pytest
from redis.asyncio import Redis

from lib.backend import PRELUDE, load_script, script_source
from tests.execution.scripts.contract import PACKAGE, now_ms

SCRIPTS = [
    "admit.lua", "append.lua", "claim.lua", "read.lua",
    "renew.lua", "start.lua", "store.lua", "watch.lua",
    "slots.lua", "quota.lua",
]  # fmt: skip


def package_of(name: str) -> str:
    """The package a script lives in (next to the module that runs it)."""
    return {"slots.lua": "lib.workflows", "quota.lua": "lib"}.get(name, PACKAGE)


def header_and_body(name: str) -> tuple[str, str]:
    text = load_script(package_of(name), name)
    start = text.index("--[[")
    end = text.index("]]", start)
    return text[start:end], text[end:]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_prelude_comes_once_before_the_script_after_its_flags_line(name: str) -> None:
    prelude, body = load_script(*PRELUDE), load_script(package_of(name), name)
    source = script_source(package_of(name), name)
    assert source.count(prelude) == 1 and source.endswith(body.partition("\n")[2])
    if body.startswith("#!"):
        assert source.partition("\n")[0] == body.partition("\n")[0]
    else:
        assert source.startswith(prelude)


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_script_builds_a_name_or_reads_the_clock_itself(name: str) -> None:
    _, body = header_and_body(name)
    assert not re.search(r'":|:{|string\.match\(\s*(KEYS|stream|meta)', body), name
    assert '"TIME"' not in body, "scripts read Redis's clock through the prelude's now_ms"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_header_names_every_key_and_argument_the_script_reads(name: str) -> None:
    header, body = header_and_body(name)
    used = set(re.findall(r"(?:KEYS|ARGV)\[\d+\]", body))
    assert used, name
    assert sorted(index for index in used if index not in header) == []


async def test_now_ms_is_redis_clock_in_milliseconds(redis: Redis) -> None:
    seconds, micros = await redis.time()
    clock = await now_ms(redis, "any")
    after_seconds, after_micros = await redis.time()
    assert seconds * 1000 + micros // 1000 <= clock <= after_seconds * 1000 + after_micros // 1000
