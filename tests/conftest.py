"""Shared fixtures: one real Valkey server and one Flowcast server per test session."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.support import zygote
from tests.support.s3 import CREDENTIALS, MotoServer
from tests.support.servers import FlowcastServer, ValkeyServer


def pytest_configure(config: pytest.Config) -> None:
    # Flowcast servers are forked from one process that imported the app already
    # (tests/support/zygote.py): a start costs a fork, not an interpreter's imports.
    zygote.enable()


def pytest_unconfigure(config: pytest.Config) -> None:
    zygote.disable()


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("flowcast")


@pytest.fixture(scope="session")
async def valkey(session_dir: Path) -> AsyncIterator[ValkeyServer]:
    server = ValkeyServer(data_dir=session_dir / "valkey")
    await server.start()
    yield server
    await server.stop()


SESSION_PREFIX = "session"


@pytest.fixture(scope="session")
async def server(valkey: ValkeyServer, session_dir: Path) -> AsyncIterator[FlowcastServer]:
    # A prefix of its own: on the default one, its janitor could take over (and run with
    # its own settings) the executions of a fault test's replicas whose owner was killed.
    flowcast = FlowcastServer(
        data_dir=session_dir / "server",
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": SESSION_PREFIX,
            "FLOWCAST_SSE_PING_SECONDS": "1",
        },
    )
    await flowcast.start()
    yield flowcast
    await flowcast.stop()


@pytest.fixture
async def client(server: FlowcastServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
        yield http


@pytest.fixture
async def redis(valkey: ValkeyServer) -> AsyncIterator[Redis]:
    connection = Redis.from_url(valkey.url)
    yield connection
    await connection.aclose()


@pytest.fixture
def unique() -> str:
    """A short unique suffix, so tests sharing the session's server never collide."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def valkey_url(valkey: ValkeyServer) -> str:
    return valkey.url


@pytest.fixture(scope="session")
async def moto(session_dir: Path) -> AsyncIterator[MotoServer]:
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    server = MotoServer(log_path=session_dir / "moto.log")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def own_valkey(tmp_path: Path) -> AsyncIterator[ValkeyServer]:
    """A Valkey of the test's own: faults injected into it reach no other test.

    Durable (``appendfsync always``): a test that kills it and starts it again means
    "Redis restarted, having lost nothing"; with the default ``everysec`` the last
    second of writes may be gone too, a different fault (a store restored behind,
    which the restore tests inject on purpose). A start test failed in CI that way."""
    server = ValkeyServer(data_dir=tmp_path / "valkey", durable=True)
    await server.start()
    yield server
    await server.stop()
