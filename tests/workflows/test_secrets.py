"""SecretStore on a real Valkey (encryption bound to tenant and name) and the redactors."""

from __future__ import annotations

import asyncio
import os

import pytest
from redis.asyncio import Redis

from lib.errors import BlockError
from lib.workflows.redact import Redactor, spellings
from lib.workflows.secrets import SecretStore


@pytest.fixture
def prefix(unique: str) -> str:
    return f"secrets-{unique}"


async def test_a_value_comes_back_only_for_its_own_tenant_and_name(
    redis: Redis, prefix: str
) -> None:
    store = SecretStore(redis=redis, key=b"k" * 32, prefix=prefix)
    await store.put("alpha", "TOKEN", "s3cr3t-value")
    assert await store.reveal("alpha", {"TOKEN"}) == {"TOKEN": "s3cr3t-value"}
    with pytest.raises(BlockError) as missing:
        await store.reveal("beta", {"TOKEN"})
    assert missing.value.code == "secret_missing" and not missing.value.retryable
    # A sealed value copied to another tenant or name does not open there.
    sealed = await redis.hget(f"{prefix}:secrets:alpha", "TOKEN")
    assert sealed is not None
    await redis.hset(f"{prefix}:secrets:beta", "TOKEN", sealed)
    await redis.hset(f"{prefix}:secrets:alpha", "OTHER", sealed)
    for tenant, name in (("beta", "TOKEN"), ("alpha", "OTHER")):
        with pytest.raises(BlockError) as unreadable:
            await store.reveal(tenant, {name})
        assert unreadable.value.code == "secret_unreadable"
        assert "s3cr3t" not in unreadable.value.message


async def test_another_server_key_cannot_open_a_value(redis: Redis, prefix: str) -> None:
    await SecretStore(redis=redis, key=b"one-key", prefix=prefix).put("t", "A", "value-1")
    with pytest.raises(BlockError) as unreadable:
        await SecretStore(redis=redis, key=b"another-key", prefix=prefix).reveal("t", {"A"})
    assert "FLOWCAST_SECRET_KEY" in unreadable.value.message


async def test_the_process_masks_every_value_it_revealed(redis: Redis, prefix: str) -> None:
    store = SecretStore(redis=redis, key=b"k", prefix=prefix)
    await store.put("t", "A", "hunter2-long")
    assert store.redact_text("x hunter2-long y") == "x hunter2-long y"  # not revealed yet
    await store.reveal("t", {"A"})
    assert store.redact_text("x hunter2-long y") == "x *** y"


@pytest.mark.parametrize("read", ["masks", "reveal"])
async def test_reading_many_large_secrets_lets_other_tasks_run_between_values(
    redis: Redis, prefix: str, read: str
) -> None:
    """Was a stall (SPEC §8, no tenant can slow another): every spelling of every value
    a run read was worked out in one go on the event loop, ~2 ms of CPU per 8 KiB
    value: a workflow reading its 64 allowed secrets held every tenant's requests
    ~0.15 s at once (0.3-0.8 s on a busy CPU). Another task must get a turn between
    any two values worked out. Found by the step 15 flake review (issue 23, point 6)."""
    store = SecretStore(redis=redis, key=b"k" * 32, prefix=prefix)
    names = {f"K{i}" for i in range(16)}
    for name in names:
        await store.put("alpha", name, os.urandom(4000).hex())  # never spelled before
    seen: list[int] = []  # how many values were spelled so far, at each turn

    async def other_tenant() -> None:
        while True:
            seen.append(spellings.cache_info().misses)
            await asyncio.sleep(0)

    before = spellings.cache_info().misses
    beside = asyncio.create_task(other_tenant())
    try:
        await getattr(store, read)("alpha", names)
    finally:
        beside.cancel()
    spelled = spellings.cache_info().misses - before
    assert spelled >= len(names)
    assert set(range(before, before + spelled + 1)) <= set(seen), sorted(set(seen))


def test_values_are_masked_in_text_json_and_their_usual_spellings() -> None:
    redactor = Redactor(["p@ss word/1", "short"])
    assert redactor.text("a p@ss word/1 b") == "a *** b"
    assert redactor.text("https://h/?k=p%40ss%20word%2F1") == "https://h/?k=***"
    assert redactor.text("k=p%40ss+word%2F1") == "k=***"
    assert redactor.value({"short": ["a short b", 3, None]}) == {"***": ["a *** b", 3, None]}


def test_a_value_split_over_chunks_is_masked_and_nothing_else_is_lost() -> None:
    chunks = Redactor(["abc-def-ghi"]).stream()
    sent = [chunks.feed(piece) for piece in ["say ", "abc-", "def", "-ghi", " and ab", "c"]]
    sent.append(chunks.flush())
    assert "".join(sent) == "say *** and abc"
    assert "abc-def-ghi" not in sent


def test_an_empty_redactor_changes_nothing() -> None:
    redactor = Redactor()
    assert not redactor
    assert redactor.value({"a": "b"}) == {"a": "b"}
    assert redactor.stream().feed("text") == "text"
