"""The S3 value store (any S3-compatible service); the only module that imports boto3.

boto3 is blocking, so every call runs in a worker thread and the event loop never waits
on the network: threads of this store's own (``S3_THREADS``), so that an endpoint that
answers nothing, each call held for boto3's timeouts and retries, never takes the
threads the rest of the process shares (the loop's default pool, which also resolves
every outbound host name for the ``http`` blocks and the webhooks). Objects live under
``<prefix><execution id>/<value id>``; values of expired executions go with the
bucket's lifecycle rule or the sweeper (see README).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from lib.errors import NotFound
from lib.execution.values import (
    CHUNK_BYTES,
    EXECUTION_ID,
    RECORD_NAME,
    RECORD_PREFIX,
    Sha256Check,
    ValueStoreError,
    check_ids,
    check_record,
)

MISSING = {"NoSuchKey", "404", "NotFound"}
# A PUT of at most this many bytes is sent whole at once, without ``Expect:
# 100-continue`` (botocore asks for it on every PUT with a body): waiting for the
# server's go-ahead only pays for a body large enough to be worth not sending when it
# would be refused. The durable records (ceiling.py, finals.py) and most values are a
# few hundred bytes; the wait, a poll and a read more each, cost the worker ~0.1 ms of
# CPU per PUT and ~1 ms of wall time (moto; bench starts-cost).
SMALL_PUT_BYTES = 64 * 1024
# The store's own threads, and as many pooled connections (botocore's default is 10).
S3_THREADS = 16

T = TypeVar("T")


def _send_small_whole(request: Any, **_: Any) -> None:
    """botocore's ``before-send`` hook: no ``Expect: 100-continue`` on a small PUT."""
    length = request.headers.get("Content-Length")
    if length is not None and int(length) <= SMALL_PUT_BYTES:
        request.headers.pop("Expect", None)


class S3ValueStore:
    """Values as S3 objects in one bucket under an optional prefix."""

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        client: Any = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self._client = client or boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(
                retries={"max_attempts": 3, "mode": "standard"},
                max_pool_connections=S3_THREADS,
            ),
        )
        if client is None:
            self._client.meta.events.register("before-send.s3.PutObject", _send_small_whole)

        self._threads = ThreadPoolExecutor(max_workers=S3_THREADS, thread_name_prefix="s3")
        # When (monotonic) each call in flight began, until its thread is done (also
        # after its caller stopped waiting); when the endpoint last answered anything.
        self._asked: dict[int, float] = {}
        self._numbers = itertools.count()
        self._answered = 0.0

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function`` in one of the store's threads (as ``asyncio.to_thread``, in its
        own pool). A caller that stops waiting (a timeout) leaves the call in flight
        until its thread is done (``silent_seconds``)."""
        context = contextvars.copy_context()
        call = functools.partial(context.run, function, *args, **kwargs)
        number = next(self._numbers)
        self._asked[number] = time.monotonic()
        future = asyncio.get_running_loop().run_in_executor(self._threads, call)

        def done(future: asyncio.Future[T]) -> None:
            del self._asked[number]
            error = None if future.cancelled() else future.exception()
            if error is None or isinstance(error, ClientError):  # the endpoint answered
                self._answered = time.monotonic()

        future.add_done_callback(done)
        return await asyncio.shield(future)

    def silent_seconds(self) -> float:
        if not self._asked:
            return 0.0
        return time.monotonic() - max(self._answered, min(self._asked.values()))

    def _key(self, execution_id: str, value: str) -> str:
        check_ids(execution_id, value)
        return f"{self.prefix}{execution_id}/{value}"

    async def put(self, execution_id: str, value: str, data: bytes) -> None:
        await self._put(self._key(execution_id, value), data, f"value {value}")

    async def _put(self, key: str, data: bytes, what: str) -> None:
        try:
            await self._call(
                self._client.put_object,
                Bucket=self.bucket,
                Key=key,
                Body=data,
                ContentType="application/json",
            )
        except (BotoCoreError, ClientError) as exc:
            raise ValueStoreError(f"could not store {what}: {exc}") from exc

    async def read(self, execution_id: str, value: str) -> AsyncIterator[bytes]:
        key = self._key(execution_id, value)
        try:
            response = await self._call(self._client.get_object, Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in MISSING:
                raise NotFound("value", value) from None
            raise ValueStoreError(f"could not read value {value}: {exc}") from exc
        except BotoCoreError as exc:
            raise ValueStoreError(f"could not read value {value}: {exc}") from exc
        body = response["Body"]
        check = Sha256Check(value)
        try:
            while chunk := await self._call(body.read, CHUNK_BYTES):
                yield check.update(chunk)
        except (BotoCoreError, ClientError) as exc:
            raise ValueStoreError(f"reading value {value} failed: {exc}") from exc
        finally:
            body.close()
        check.verify(execution_id, value)

    async def put_record(self, execution_id: str, name: str, data: bytes) -> None:
        check_record(execution_id, name)
        await self._put(f"{self.prefix}{execution_id}/{name}", data, f"record {name}")

    async def records(self, execution_id: str) -> list[bytes]:
        if not EXECUTION_ID.match(execution_id):
            return []
        prefix = f"{self.prefix}{execution_id}/{RECORD_PREFIX}"

        def read() -> list[bytes]:
            found: list[bytes] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    if not RECORD_NAME.match(item["Key"].rpartition("/")[2]):
                        continue
                    try:
                        response = self._client.get_object(Bucket=self.bucket, Key=item["Key"])
                    except ClientError as exc:
                        if exc.response.get("Error", {}).get("Code") in MISSING:
                            continue  # swept meanwhile
                        raise
                    found.append(response["Body"].read())
            return found

        try:
            return await self._call(read)
        except (BotoCoreError, ClientError) as exc:
            raise ValueStoreError(f"could not read the records of {execution_id}: {exc}") from exc

    async def delete_execution(self, execution_id: str) -> None:
        prefix = f"{self.prefix}{execution_id}/"

        def delete() -> None:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                keys: list[Any] = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if keys:
                    self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})

        try:
            await self._call(delete)
        except (BotoCoreError, ClientError) as exc:
            raise ValueStoreError(f"could not delete values of {execution_id}: {exc}") from exc

    async def executions(self) -> list[str]:
        def scan() -> list[str]:
            found: list[str] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    found.append(common["Prefix"][len(self.prefix) :].rstrip("/"))
            return found

        try:
            return await self._call(scan)
        except (BotoCoreError, ClientError) as exc:
            raise ValueStoreError(f"could not list values: {exc}") from exc

    async def ping(self) -> bool:
        try:
            await self._call(self._client.head_bucket, Bucket=self.bucket)
        except (BotoCoreError, ClientError):
            return False
        return True
