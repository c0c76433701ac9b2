"""The value store contract, run against the local directory and S3 (moto over HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from lib.errors import NotFound
from lib.execution.s3 import SMALL_PUT_BYTES, S3ValueStore
from lib.execution.values import (
    CorruptValue,
    LocalValueStore,
    ValueStore,
    ValueStoreError,
    value_id,
)
from tests.support.api import until
from tests.support.s3 import MotoServer


@pytest.fixture(params=["local", "s3"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, moto: MotoServer
) -> AsyncIterator[ValueStore]:
    if request.param == "local":
        yield LocalValueStore(root=tmp_path / "values")
        return
    bucket = f"values-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=moto.url)
    client.create_bucket(Bucket=bucket)
    yield S3ValueStore(bucket=bucket, prefix="fc/", endpoint_url=moto.url)


def ident(data: bytes) -> str:
    return value_id(hashlib.sha256(data).hexdigest())


async def read_all(store: ValueStore, execution_id: str, value: str) -> bytes:
    return b"".join([chunk async for chunk in store.read(execution_id, value)])


async def test_a_stored_value_reads_back_whole(store: ValueStore) -> None:
    data = b'"' + b"x" * 3_000_000 + b'"'
    await store.put("ex_one", ident(data), data)
    assert await read_all(store, "ex_one", ident(data)) == data
    assert await store.ping()


async def test_an_unknown_value_or_another_executions_value_is_not_found(
    store: ValueStore,
) -> None:
    data = b"[1,2,3]"
    await store.put("ex_one", ident(data), data)
    with pytest.raises(NotFound):
        await read_all(store, "ex_two", ident(data))
    with pytest.raises(NotFound):
        await read_all(store, "ex_one", ident(b"other"))


async def test_ids_that_were_never_issued_are_not_found(store: ValueStore) -> None:
    for execution_id, value in [
        ("../etc", ident(b"1")),
        ("ex_one", "lv_../../secret"),
        ("ex_one", "lv_" + "g" * 64),
        ("ex one", ident(b"1")),
    ]:
        with pytest.raises(NotFound):
            await read_all(store, execution_id, value)


async def test_content_that_does_not_match_its_sha256_is_refused(
    store: ValueStore, tmp_path: Path, moto: MotoServer
) -> None:
    data = b'{"a": 1}'
    value = ident(data)
    await store.put("ex_bad", value, data)
    if isinstance(store, LocalValueStore):
        (store.root / "ex_bad" / value).write_bytes(b'{"a": 2}')
    else:
        assert isinstance(store, S3ValueStore)
        client = boto3.client("s3", endpoint_url=moto.url)
        client.put_object(Bucket=store.bucket, Key=f"fc/ex_bad/{value}", Body=b'{"a": 2}')
    with pytest.raises(CorruptValue):
        await read_all(store, "ex_bad", value)


async def test_values_are_listed_and_deleted_per_execution(store: ValueStore) -> None:
    for execution_id in ("ex_keep", "ex_drop"):
        for data in (b"1", b"2"):
            await store.put(execution_id, ident(data), data)
    assert sorted(await store.executions()) == ["ex_drop", "ex_keep"]
    await store.delete_execution("ex_drop")
    assert await store.executions() == ["ex_keep"]
    with pytest.raises(NotFound):
        await read_all(store, "ex_drop", ident(b"1"))
    assert await read_all(store, "ex_keep", ident(b"2")) == b"2"


async def test_records_are_replaced_by_name_read_per_execution_and_deleted_with_it(
    store: ValueStore,
) -> None:
    """The durable records of ceiling.py and finals.py: small objects beside the values,
    one per name, replaced whole; never served as a value; swept with the execution."""
    one, two = "rec_" + "a" * 16, "rec_" + "b" * 16
    assert await store.records("ex_rec") == []
    await store.put_record("ex_rec", one, b'{"ceiling":1}')
    await store.put_record("ex_rec", one, b'{"ceiling":2}')
    await store.put_record("ex_rec", two, b'{"ceiling":3}')
    await store.put_record("ex_other", one, b'{"ceiling":9}')
    await store.put("ex_rec", ident(b"1"), b"1")
    assert sorted(await store.records("ex_rec")) == [b'{"ceiling":2}', b'{"ceiling":3}']
    with pytest.raises(NotFound):
        await read_all(store, "ex_rec", one)
    for execution_id, name in [("../etc", one), ("ex_rec", "rec_../x"), ("ex_rec", "lv_1")]:
        with pytest.raises(NotFound):
            await store.put_record(execution_id, name, b"{}")
    await store.delete_execution("ex_rec")
    assert await store.records("ex_rec") == []
    assert await store.records("ex_other") == [b'{"ceiling":9}']


@pytest.mark.timeout(60)
async def test_a_small_put_is_sent_whole_and_a_large_one_waits_for_the_go_ahead(
    moto: MotoServer,
) -> None:
    """A durable record (a few hundred bytes) is sent without ``Expect: 100-continue``:
    no wait for the server's go-ahead, which cost the worker CPU and a round trip per
    execution (issue 25). A large value still asks first; both are stored."""
    bucket = f"values-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket=bucket)
    store = S3ValueStore(bucket=bucket, prefix="fc/", endpoint_url=moto.url)
    sent: list[bytes | None] = []

    def seen(request: Any, **_: Any) -> None:
        sent.append(request.headers.get("Expect"))

    store._client.meta.events.register_last("before-send.s3.PutObject", seen)
    execution_id = "ex_records"
    await store.put_record(execution_id, "rec_0123456789abcdef", b'{"ceiling": 4097}')
    large = b'"' + b"x" * (SMALL_PUT_BYTES + 1) + b'"'
    await store.put(execution_id, ident(large), large)
    assert sent == [None, b"100-continue"]
    assert await store.records(execution_id) == [b'{"ceiling": 4097}']
    assert await read_all(store, execution_id, ident(large)) == large


@contextlib.asynccontextmanager
async def answering_nothing() -> AsyncIterator[tuple[S3ValueStore, list[asyncio.StreamWriter]]]:
    """An S3 store whose endpoint accepts connections and answers nothing (black-holed),
    and the connections it holds; on leaving they are closed (the calls then fail)."""
    held: list[asyncio.StreamWriter] = []

    async def answer_nothing(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(answer_nothing, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="k",
        aws_secret_access_key="s",
        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 1}),
    )  # fmt: skip
    try:
        yield S3ValueStore(bucket="nowhere", endpoint_url=url, client=client), held
    finally:
        server.close()
        for writer in held:
            writer.close()


@pytest.mark.timeout(60)
async def test_a_value_store_that_answers_nothing_keeps_none_of_the_shared_threads() -> None:
    """An S3 endpoint that answers nothing holds each call for boto3's timeouts: more of
    them at once than the loop's default pool has threads took them all, and everything
    else of the process that runs in that pool (host name lookups of the ``http`` blocks
    and webhooks, file values) waited behind them. The store's calls run in threads of
    its own."""
    shared = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default pool
    async with answering_nothing() as (store, held):
        stuck = [asyncio.create_task(store.records(f"ex_{n}")) for n in range(shared + 2)]
        await until(lambda: len(held) >= shared, "calls held by the endpoint", 10)
        assert not any(task.done() for task in stuck)
        # The probe: one call in the loop's default pool, as a host name lookup is.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 5) == "free"
    for outcome in await asyncio.gather(*stuck, return_exceptions=True):
        assert isinstance(outcome, ValueStoreError), outcome


@pytest.mark.timeout(60)
async def test_a_store_is_silent_only_while_it_answers_nothing_at_all(moto: MotoServer) -> None:
    """``silent_seconds`` tells an endpoint that answers nothing (a call its caller gave
    up on still counts, its thread held) from one that is slow for one caller while it
    answers the others (a tenant's large values): only the first switches the check of
    how a run ended off for everyone (takeovers.py ``recall``)."""
    async with answering_nothing() as (silent, _held):
        assert silent.silent_seconds() == 0.0  # nothing asked
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(silent.records("ex_1"), 0.5)
        # Given up on, still asked: silent since the call went out, within the wait.
        assert silent.silent_seconds() >= 0.9 * (time.monotonic() - began)
    await until(lambda: silent.silent_seconds() == 0.0, "the held call failed", 10)

    bucket = f"values-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket=bucket)
    answering = S3ValueStore(bucket=bucket, endpoint_url=moto.url)
    slow = asyncio.create_task(answering._call(time.sleep, 1.5))  # one call held 1.5 s
    try:
        await until(lambda: answering.silent_seconds() > 0.5, "the slow call in flight", 10)
        await answering.put_record("ex_2", "rec_0123456789abcdef", b"{}")  # answered
        assert answering.silent_seconds() < 0.5
    finally:
        await slow
