"""Fixtures of the script contract tests: fresh names for each test, and the server a
script runs on (tests/execution/scripts/test_cluster.py swaps in the cluster's)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from lib.backend import Keys
from tests.support.servers import ValkeyServer


@pytest.fixture
def keys(unique: str) -> Keys:
    """Key and channel names under a prefix of the test's own."""
    return Keys(f"sc{unique}")


@pytest.fixture
def eid() -> str:
    return f"ex_{uuid.uuid4().hex}"


@pytest.fixture
def node_url(valkey: ValkeyServer) -> Callable[[str], str]:
    """The URL of the server that holds a key (and so runs the scripts on it)."""
    return lambda _key: valkey.url
