"""The value store seam: where large values live, as claim checks behind a ref.

A value is stored once per execution under ``<execution id>/<value id>``, where the
value id is ``lv_`` + the sha256 of the value's JSON, so the key derives from the
content and a read can check it. Two implementations: ``LocalValueStore`` (a directory,
the embedded default) here, and ``S3ValueStore`` in ``s3.py`` (the only module that
imports boto3).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from lib.errors import FlowcastError, NotFound

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
VALUE_ID = re.compile(r"^lv_[0-9a-f]{64}$")
# A durable record of an execution's owner (ceiling.py), beside its values: swept with them.
RECORD_NAME = re.compile(r"^rec_[0-9a-f]{16}$")
RECORD_PREFIX = "rec_"
EXECUTION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ValueStoreError(FlowcastError):
    """The value store could not be reached or refused the operation."""

    code = "value_store_error"


class CorruptValue(ValueStoreError):
    """A stored value's content does not match the sha256 its id promises."""

    code = "corrupt_value"


def value_id(sha256_hex: str) -> str:
    return f"lv_{sha256_hex}"


def check_record(execution_id: str, name: str) -> None:
    """Refuse a record name or execution id that could never have been issued."""
    if not EXECUTION_ID.match(execution_id) or not RECORD_NAME.match(name):
        raise NotFound("record", name)


def check_ids(execution_id: str, value: str) -> None:
    """Refuse ids that could never have been issued (also blocks path tricks)."""
    if not EXECUTION_ID.match(execution_id) or not VALUE_ID.match(value):
        raise NotFound("value", value)


class ValueStore(Protocol):
    """Three operations on immutable values, plus the listing the sweeper needs."""

    async def put(self, execution_id: str, value: str, data: bytes) -> None:
        """Store ``data`` (the value's JSON) under the execution and value id."""

    def read(self, execution_id: str, value: str) -> AsyncIterator[bytes]:
        """The value's bytes in chunks, checked against its sha256; NotFound if absent."""

    async def delete_execution(self, execution_id: str) -> None:
        """Delete every value (and record) of one execution."""

    async def put_record(self, execution_id: str, name: str, data: bytes) -> None:
        """Store (or replace) one small record of the execution, beside its values."""

    async def records(self, execution_id: str) -> list[bytes]:
        """Every record stored for the execution (none: empty)."""

    async def executions(self) -> list[str]:
        """Ids of the executions that have values stored."""

    async def ping(self) -> bool:
        """True when the store is reachable."""

    def silent_seconds(self) -> float:
        """How long the store has been asked without answering anything: 0 while it
        answers (or nothing is asked); since the oldest call in flight began, or since
        its last answer if that came later. An endpoint that answers nothing at all,
        not one slowed by a tenant's large values (its other calls answer)."""


class Sha256Check:
    """Hashes chunks as they stream by and fails at the end if the content is wrong."""

    def __init__(self, value: str) -> None:
        self._expected = value.removeprefix("lv_")
        self._hash = hashlib.sha256()

    def update(self, chunk: bytes) -> bytes:
        self._hash.update(chunk)
        return chunk

    def verify(self, execution_id: str, value: str) -> None:
        if self._hash.hexdigest() != self._expected:
            raise CorruptValue(f"value {value} of {execution_id} does not match its sha256")


class LocalValueStore:
    """Values as files under one directory: ``<root>/<execution id>/<value id>``."""

    def __init__(self, *, root: Path) -> None:
        self.root = root

    def _path(self, execution_id: str, value: str) -> Path:
        check_ids(execution_id, value)
        return self.root / execution_id / value

    async def put(self, execution_id: str, value: str, data: bytes) -> None:
        path = self._path(execution_id, value)
        try:
            await asyncio.to_thread(_write_atomically, path, data)
        except OSError as exc:
            raise ValueStoreError(f"could not store value {value}: {exc}") from exc

    async def read(self, execution_id: str, value: str) -> AsyncIterator[bytes]:
        path = self._path(execution_id, value)
        try:
            handle = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:
            raise NotFound("value", value) from None
        except OSError as exc:
            raise ValueStoreError(f"could not read value {value}: {exc}") from exc
        check = Sha256Check(value)
        try:
            while chunk := await asyncio.to_thread(handle.read, CHUNK_BYTES):
                yield check.update(chunk)
        finally:
            handle.close()
        check.verify(execution_id, value)

    async def put_record(self, execution_id: str, name: str, data: bytes) -> None:
        check_record(execution_id, name)
        path = self.root / execution_id / name
        try:
            await asyncio.to_thread(_replace_atomically, path, data)
        except OSError as exc:
            raise ValueStoreError(f"could not store record {name}: {exc}") from exc

    async def records(self, execution_id: str) -> list[bytes]:
        if not EXECUTION_ID.match(execution_id):
            return []
        folder = self.root / execution_id

        def read() -> list[bytes]:
            if not folder.is_dir():
                return []
            found = []
            for entry in os.scandir(folder):
                if RECORD_NAME.match(entry.name):
                    try:
                        found.append(Path(entry.path).read_bytes())
                    except FileNotFoundError:
                        continue  # swept meanwhile
            return found

        try:
            return await asyncio.to_thread(read)
        except OSError as exc:
            raise ValueStoreError(f"could not read the records of {execution_id}: {exc}") from exc

    async def delete_execution(self, execution_id: str) -> None:
        if not EXECUTION_ID.match(execution_id):
            return
        await asyncio.to_thread(shutil.rmtree, self.root / execution_id, True)

    async def executions(self) -> list[str]:
        def scan() -> list[str]:
            if not self.root.is_dir():
                return []
            return [entry.name for entry in os.scandir(self.root) if entry.is_dir()]

        return await asyncio.to_thread(scan)

    async def ping(self) -> bool:
        return self.root.is_dir()

    def silent_seconds(self) -> float:
        return 0.0  # a directory: its calls end or fail


def _write_atomically(path: Path, data: bytes) -> None:
    if path.exists():
        return  # same id, same content: values are immutable
    _replace_atomically(path, data)


def _replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
