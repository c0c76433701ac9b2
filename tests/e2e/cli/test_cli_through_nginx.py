"""The CLI through nginx in front of two replicas: every event once when its replica
is SIGKILLed, and a start nginx answered 502 sent again with the same key."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import (
    approval_workflow,
    execute,
    put,
    quick_workflow,
    sse_clients,
    talking_workflow,
    until,
    wait_status,
)
from tests.support.servers import ROOT, FlowcastServer, ValkeyServer

# ---------------------------------------------------------------- nginx, the CLI, a SIGKILL

PROXY_KEY = "break14-key-" + "k" * 20


PROXY_AUTH = {"Authorization": f"Bearer {PROXY_KEY}"}


async def _sse_clients(url: str) -> float:
    async with httpx.AsyncClient(base_url=url, headers=PROXY_AUTH, timeout=10) as client:
        return await sse_clients(client)


@asynccontextmanager
async def proxied_pair(
    valkey: ValkeyServer, root: Path
) -> AsyncIterator[tuple[tuple[FlowcastServer, FlowcastServer], Any]]:
    from tests.support.proxy import NginxProxy

    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": f"b14p{uuid.uuid4().hex[:6]}",
        "FLOWCAST_API_KEYS": PROXY_KEY,
        "FLOWCAST_SECRET_KEY": "break14-secret-" + "s" * 20,
        "FLOWCAST_LEASE_SECONDS": "1",
        "FLOWCAST_SSE_PING_SECONDS": "0.5",
        "FLOWCAST_SHUTDOWN_GRACE_SECONDS": "1",
    }
    pair = (
        FlowcastServer(data_dir=root / "a", env=env),
        FlowcastServer(data_dir=root / "b", env=env),
    )
    await asyncio.gather(*(server.start() for server in pair))
    try:
        addresses = (f"127.0.0.1:{pair[0].port}", f"127.0.0.1:{pair[1].port}")
        async with NginxProxy(directory=root / "nginx", replicas=addresses) as nginx:
            yield pair, nginx
    finally:
        await asyncio.gather(*(server.stop(signal.SIGKILL) for server in pair))


def _parse_plain(lines: list[str]) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """The CLI's --plain lines: (id, type) of each event, (after, resumeAt) of each gap."""
    seen: list[tuple[int, str]] = []
    gaps: list[tuple[int, int]] = []
    for line in lines:
        if line.startswith("gap "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            gaps.append((int(fields["after"]), int(fields["resumeAt"])))
        elif line[:1].isdigit():
            number, kind = line.split()[:2]
            seen.append((int(number), kind))
    return seen, gaps


@pytest.mark.skipif(not Path("/usr/sbin/nginx").exists(), reason="nginx is missing")
@pytest.mark.timeout(90)
async def test_the_cli_through_nginx_gets_every_event_once_when_its_replica_is_sigkilled(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # `flowcast run` through nginx; the replica that runs the execution and serves the
    # CLI's stream is SIGKILLed mid-run. The other takes the execution over; the CLI
    # reconnects through nginx with Last-Event-ID. It must print each id once, in
    # order, a hole only behind a reported gap, no id naming another event than the
    # stored one, and exit 0 on the completed event.
    """Found by the step 14 review."""
    async with proxied_pair(valkey, tmp_path) as ((a, b), nginx):
        async with httpx.AsyncClient(base_url=nginx.url, headers=PROXY_AUTH, timeout=20) as via:
            workflow_id = f"cli-{unique}"
            await put(via, talking_workflow(workflow_id, words=60, tps=10))
            # A long stream on one replica first (a paused execution's): least_conn then
            # sends the CLI's POST and its stream both to the other, killed below.
            await put(via, approval_workflow(f"ballast-{unique}"))
            ballast_id = await execute(via, f"ballast-{unique}", {})
            await wait_status(via, ballast_id, "paused")
            stream_url = f"/api/executions/{ballast_id}/stream"
            async with via.stream("GET", stream_url) as ballast:
                assert ballast.status_code == 200

                async def attached() -> bool:
                    return await _sse_clients(a.url) + await _sse_clients(b.url) >= 1

                await until(attached, "the ballast stream attached", 10, every=0.05)
                victim = b if await _sse_clients(a.url) == 1 else a
                cli = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "app.cli", "--url", nginx.url,
                    "--api-key", PROXY_KEY, "run", workflow_id, "--plain",
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                )  # fmt: skip
                assert cli.stdout is not None and cli.stderr is not None
                lines: list[str] = []
                async with asyncio.timeout(20):
                    while sum(line[:1].isdigit() for line in lines) < 8:
                        raw = await cli.stdout.readline()
                        assert raw, (lines, await cli.stderr.read())
                        lines.append(raw.decode().rstrip("\n"))
                execution_id = lines[0].split()[1]
                assert await _sse_clients(victim.url) == 1  # the CLI's stream is there
                await victim.stop(signal.SIGKILL)
                async with asyncio.timeout(45):
                    rest, errors = await cli.communicate()
                lines += rest.decode().splitlines()
            survivor = a if victim is b else b
            async with httpx.AsyncClient(
                base_url=survivor.url, headers=PROXY_AUTH, timeout=20
            ) as direct:
                stored = (
                    await direct.get(f"/api/executions/{execution_id}/events?after=0&limit=1000")
                ).json()["events"]
    assert cli.returncode == 0, (cli.returncode, lines, errors.decode())
    seen, gaps = _parse_plain(lines)
    ids = [number for number, _ in seen]
    assert ids == sorted(set(ids)), ids
    for before, after in itertools.pairwise(ids):
        if after != before + 1:
            assert (before, after) in gaps, (before, after, gaps)
    by_id = {event["id"]: event["type"] for event in stored}
    clashes = [(n, kind, by_id[n]) for n, kind in seen if n in by_id and by_id[n] != kind]
    assert not clashes, clashes
    assert seen[-1] == (stored[-1]["id"], "execution:completed"), (seen[-5:], stored[-1])
    assert "execution:recovered" in by_id.values()


@pytest.mark.skipif(not Path("/usr/sbin/nginx").exists(), reason="nginx is missing")
@pytest.mark.timeout(60)
async def test_the_cli_sends_a_start_nginx_answered_502_again_with_the_same_key(
    valkey: ValkeyServer, tmp_path: Path, unique: str
) -> None:
    # nginx answers 502 when the replica it gave a POST to died with it: it may have
    # started the execution, so nginx does not resend it and says "try again (a POST with
    # the same Idempotency-Key)". `flowcast run` makes that key up itself and never
    # prints it: exiting 5 ("worth a retry later") leaves the user a retry with a new
    # key, a second execution if the first had started. It must retry itself.
    """Found by the step 14 review."""
    from tests.support.proxy import Dropper, NginxProxy

    env = {
        "FLOWCAST_REDIS_URL": valkey.url,
        "FLOWCAST_REDIS_PREFIX": f"b14d{uuid.uuid4().hex[:6]}",
        "FLOWCAST_API_KEYS": PROXY_KEY,
        "FLOWCAST_SECRET_KEY": "break14-secret-" + "s" * 20,
    }
    replica = FlowcastServer(data_dir=tmp_path / "replica", env=env)
    await replica.start()
    try:
        async with Dropper(once=True) as dropper:
            upstreams = (dropper.address, f"127.0.0.1:{replica.port}")
            async with NginxProxy(directory=tmp_path / "nginx", replicas=upstreams) as nginx:
                async with httpx.AsyncClient(
                    base_url=replica.url, headers=PROXY_AUTH, timeout=20
                ) as direct:
                    workflow_id = f"again-{unique}"
                    await put(direct, quick_workflow(workflow_id))
                    cli = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "app.cli", "--url", nginx.url,
                        "--api-key", PROXY_KEY, "run", workflow_id, "--plain",
                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    )  # fmt: skip
                    async with asyncio.timeout(30):
                        out, err = await cli.communicate()
                    listed = (await direct.get(f"/api/executions?workflowId={workflow_id}")).json()[
                        "executions"
                    ]
    finally:
        await replica.stop()
    assert dropper.received == [f"POST /api/workflows/{workflow_id}/execute"]
    assert cli.returncode == 0, (cli.returncode, out.decode(), err.decode())
    assert len(listed) == 1, listed
