"""The hostile-tenant scenario (SPEC §8 "Tenants are untrusted"): one Flowcast replica
with three API keys; a hostile tenant loops over payloads meant to make the server fetch,
stall or swell, while a well-behaved tenant runs small executions and plain GETs beside it.

What must hold, each broken rule a finding:

- hostile: a schema ``$ref`` outside the schema (``http://127.0.0.1:PORT``,
  ``file:///etc/passwd``) is 422 at PUT and the listener on PORT sees no connection; a
  catastrophic ``pattern`` answers its resume 422 within ``FAST`` seconds; past the caps
  on executions (paused ones count) and on open streams a tenant gets 429 with
  ``Retry-After``; a body that trickles in gets 408; a stream token sent as ``?%74oken=``
  (and other spellings) never appears in the server log; a template that would build
  200 MB is stored within ``FAST`` seconds without growing the server, and its run fails
  the block. With ``include_templates`` (the default) also loops, repetition, padding,
  ``format`` and ``lipsum`` bombs: stored fast, run failed. Issue 24's payloads: a
  template or ``when`` nested past any parser's stack is 422 with both paths; a config
  rendering a 1 MB input 300 times fails its block before it is built; a keyless request
  announcing a 10 MiB body gets its 401 before sending it; a 3-character secret is 422;
  six filtered lists at once answer within ``FAST`` seconds; a 10 MB input echoed by a
  ``transform`` fails its block (past the template bound). A third tenant, the
  hoarder, stores 256 KiB workflows until it is refused 429 ``storage_quota`` (SPEC §8
  "Shares per tenant", ``FLOWCAST_TENANT_STORAGE_BYTES``), then smaller ones until
  nothing fits; from then on a new workflow and a new execution of its are 429
  ``storage_quota`` every round, nothing of them written, while a well-behaved PUT
  beside it is stored;
- well-behaved: request latency p99 under 100 ms, every execution completes, every
  stream ends;
- the server's resident memory stays under its baseline + ``RSS_ALLOWANCE`` (VmHWM,
  so a spike between samples counts too); no 5xx; no error line or traceback in its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from app.auth import tenant_of_key
from lib.quota import StorageQuota
from stress.harness import (
    Budget,
    Report,
    View,
    bounded,
    counting,
    follow,
    judging,
    server_errors,
    stored_log,
    verify,
    wait_terminal,
)
from stress.workflows import check_work
from tests.support.servers import FlowcastServer, ValkeyServer

HOSTILE = "hostile-key-" + "h" * 20
GOOD = "good-key-" + "g" * 20
HOARDER = "hoarder-key-" + "k" * 20
CAP = 20  # FLOWCAST_MAX_EXECUTIONS_PER_TENANT and FLOWCAST_MAX_STREAMS_PER_TENANT
BODY_TIMEOUT = 2.0  # FLOWCAST_BODY_TIMEOUT_SECONDS
CLOSE_WITHIN = 3.0  # seconds after its 408 by which a trickling connection is closed
FAST = 0.5  # seconds: a refused PUT or resume, or a stored template, answers within this
P99_LIMIT = 0.100  # seconds: the well-behaved tenant's request latency, on a quiet machine
# On a busy one the bound follows the good tenant's own p99 measured alone first, in the
# same run (QUIET_SECONDS): at most QUIET_RATIO times it plus QUIET_MARGIN, if above.
QUIET_SECONDS = 4.0
QUIET_RATIO = 3
QUIET_MARGIN = 0.050
RSS_ALLOWANCE = 300 * 1024 * 1024  # bytes above the baseline the server may reach
FOLD_GROWTH = 50 * 1024 * 1024  # bytes one PUT of the folding template may add
MIB = 1024 * 1024
# FLOWCAST_TENANT_STORAGE_BYTES: above what the hostile tenant keeps by the run's end
# (its ``repeat`` runs keep their 1 MB input each: ~12 MiB in 11 rounds), so only the
# hoarder reaches it.
QUOTA = 24 * MIB
LONG_QUOTA = 256 * MIB
# The constant each of the hoarder's workflows holds. (At 1 MiB a PUT held the loop
# long enough to lift another tenant's p99 past 100 ms on a loaded machine.)
HOARD = 256 * 1024
# The hostile tenant waits this long after each answer (at most ~50 requests/s): what it
# sends, not how fast, is on trial; SPEC has no request-rate limit, and a flood from one
# client only measures the machine's spare CPU.
PACE = 0.02

FOLD = "{{ '%0200000000d' % 1 }}"  # folded at compile time, before any bound, once
# Each one blocks an unbounded evaluator for seconds or builds hundreds of MB; bounded
# now that templates run in worker processes (issue 13).
BOMBS = (
    "{% for a in [0]*800 %}{% for b in [0]*1000000 %}{% endfor %}{% endfor %}",
    "{{ [[0]*1000000]*1000 }}",
    "{{ 'a'|center(200000000) }}",
    "{{ '{:>200000000}'.format(1) }}",
    "{{ lipsum(100, false, 100000, 100001) }}",
)
TOKEN_SPELLINGS = ("%74oken", "to%6Ben", "%74%6F%6B%65%6E")
# Issue 24's payloads: templates nested past any parser's stack (422 with the path), a
# config that repeats a 1 MB input 300 times (fails before it is built), a keyless 10 MiB
# body (401 before it is read), a secret too short to mask (422).
NESTED = ("(" * 3000 + "1" + ")" * 3000, "[" * 3000 + "]" * 3000, "input" + ".a" * 5000)
REPEATS = {"value": ["{{ input.s }}"] * 300}
# Issue 24 row 1: an input of 5 million zeros (10 MB, under the 10 MiB body bound) echoed
# by ``quick``: parsed, checked, stored and sized in slices; the run fails its block
# (the echo renders past FLOWCAST_TEMPLATE_MAX_BYTES) and nobody else is slowed.
ZEROS = 5_000_000


@functools.cache
def zeros_body() -> bytes:
    """The echo's execute body, built once (when the payload first runs)."""
    return b'{"input":[' + b",".join([b"0"] * ZEROS) + b"]}"


def rss(pid: int, field_name: str = "VmRSS") -> int:
    """One line of /proc/<pid>/status, in bytes (VmRSS now, VmHWM the peak so far); 0
    once the process is gone (its clients' errors say so)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    for line in status.splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    return 0


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def approval(workflow_id: str, schema: Any) -> dict[str, Any]:
    block = {"id": "ask", "type": "approval", "config": {"prompt": "?", "schema": schema}}
    return {"id": workflow_id, "blocks": [block], "edges": []}


def transform(workflow_id: str, value: str) -> dict[str, Any]:
    block = {"id": "f", "type": "transform", "timeoutMs": 1000, "config": {"value": value}}
    return {"id": workflow_id, "blocks": [block], "edges": []}


GOOD_WORKFLOW = {
    "id": "polite",
    "blocks": [
        {"id": "shape", "type": "transform", "config": {"value": {"n": "{{ input.n }}"}}},
        {
            "id": "say",
            "type": "generate",
            "config": {"text": "one two three four five", "tokensPerSecond": 100},
        },
    ],
    "edges": [{"from": "shape", "to": "say"}],
}


class Listener:
    """A loopback HTTP server that counts every connection: a fetched ``$ref`` lands here."""

    def __init__(self) -> None:
        self.hits = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hits += 1
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{"type":"string"}')
        await writer.drain()
        writer.close()


@dataclass
class Tenants:
    """The replica and one counted client per caller: hostile, well-behaved, token-only,
    hoarder; ``client`` makes another (the well-behaved tenant's own, in its own thread)."""

    server: FlowcastServer
    client: Callable[[str | None], httpx.AsyncClient]
    hostile: httpx.AsyncClient
    good: httpx.AsyncClient
    anonymous: httpx.AsyncClient
    hoarder: httpx.AsyncClient
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    slowest: dict[str, float] = field(default_factory=dict)
    tokens: list[str] = field(default_factory=list)
    doing: str = "nothing"  # the hostile tenant's current step, to name what slowed a request
    slow: Counter[str] = field(default_factory=Counter)

    def took(self, what: str, seconds: float) -> None:
        self.slowest[what] = max(self.slowest.get(what, 0.0), round(seconds, 3))


@contextlib.asynccontextmanager
async def tenants(root: Path, report: Report, quota: int = QUOTA) -> AsyncIterator[Tenants]:
    """Valkey and one Flowcast process with the three keys, small caps, a storage quota
    of ``quota`` bytes and the access log on (a token in a URL would reach the log
    there). Every request counts against the budget; a 5xx, an error line or a
    traceback in the log is a finding."""
    report.data_dir = root

    count, judge = counting(report), judging(report)

    valkey = ValkeyServer(data_dir=root / "valkey")
    await valkey.start()
    server = FlowcastServer(
        data_dir=root / "server",
        access_log=True,
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_API_KEYS": f"{HOSTILE},{GOOD},{HOARDER}",
            "FLOWCAST_MAX_EXECUTIONS_PER_TENANT": str(CAP),
            "FLOWCAST_MAX_STREAMS_PER_TENANT": str(CAP),
            "FLOWCAST_BODY_TIMEOUT_SECONDS": str(BODY_TIMEOUT),
            "FLOWCAST_TENANT_STORAGE_BYTES": str(quota),
            "FLOWCAST_SSE_PING_SECONDS": "1",
            "FLOWCAST_LOG_LEVEL": "info",
        },
    )

    async def pace(response: httpx.Response) -> None:
        await asyncio.sleep(PACE)

    def client(key: str | None) -> httpx.AsyncClient:
        paced = key != GOOD
        return httpx.AsyncClient(
            base_url=server.url,
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(30, read=15),
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=100),
            event_hooks={"request": [count], "response": [judge, *([pace] if paced else [])]},
        )

    try:
        await server.start()
        async with (
            client(HOSTILE) as hostile,
            client(GOOD) as good,
            client(None) as anonymous,
            client(HOARDER) as hoarder,
        ):
            yield Tenants(server, client, hostile, good, anonymous, hoarder)
    finally:
        with contextlib.suppress(Exception):
            report.figures["kept_mib"] = await kept(valkey, quota)
        await server.stop()
        await valkey.stop()
        logs = server.logs()
        errors = server_errors(logs)
        report.figures["server_errors"] = len(errors)
        if errors:
            report.find(f"{len(errors)} error lines in the server log, first: {errors[0]}")
        tracebacks = [line for line in logs.splitlines() if "Traceback" in line]
        if tracebacks:
            report.find(f"{len(tracebacks)} tracebacks in the server log: {tracebacks[0][:300]}")


async def kept(valkey: ValkeyServer, quota: int) -> dict[str, float]:
    """What each tenant keeps in the Redis, as its ledger counts it, in MiB."""
    redis = Redis.from_url(valkey.url)
    try:
        ledger = StorageQuota(redis=redis, limit_bytes=quota)
        names = {"hostile": HOSTILE, "good": GOOD, "hoarder": HOARDER}
        return {
            name: round(await ledger.usage(tenant_of_key(key)) / MIB, 1)
            for name, key in names.items()
        }
    finally:
        await redis.aclose()


async def put(client: httpx.AsyncClient, workflow: dict[str, Any]) -> httpx.Response:
    return await client.put(f"/api/workflows/{workflow['id']}", json=workflow)


async def until_paused(client: httpx.AsyncClient, execution_id: str, deadline: float) -> bool:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline):
            while True:
                response = await client.get(f"/api/executions/{execution_id}")
                if response.status_code == 200 and response.json()["status"] == "paused":
                    return True
                await asyncio.sleep(0.05)
    return False


# -- the hostile tenant ----------------------------------------------------------------


class Hostile:
    """One round of every payload, in turn; the trickling bodies run beside it."""

    def __init__(
        self, t: Tenants, report: Report, listener_port: int, templates: bool, quota: int = QUOTA
    ) -> None:
        self.t, self.report, self.templates = t, report, templates
        self.client = t.hostile
        self.port = listener_port
        self.quota = quota
        self.hoarded: list[str] = []  # the hoarder's stored workflows

    def find(self, message: str) -> None:
        self.report.find(f"hostile: {message}")

    async def prepare(self) -> None:
        for workflow in (
            approval("redos", {"type": "string", "pattern": "^(a+)+$"}),
            approval("hold", {"type": "boolean"}),
            transform("quick", "{{ input }}"),
            {"id": "repeat", "blocks": [{"id": "r", "type": "transform", "config": REPEATS}]},
        ):
            (await put(self.client, workflow)).raise_for_status()

    async def round(self) -> None:
        steps = [
            self.refs, self.redos, self.fold, self.token, self.lists, self.caps,
            self.nested, self.repeat, self.echo, self.keyless, self.short_secret, self.hoard,
        ]  # fmt: skip
        if self.templates:
            steps[3:3] = [self.bombs]
        for step in steps:
            self.t.doing = step.__name__
            try:
                await step()
            except httpx.TransportError as exc:
                # A server that cannot answer the hostile tenant within the read timeout
                # is stalled for everyone: a finding, then on with the next payload.
                self.find(f"{self.t.doing}: {type(exc).__name__} from the server")

    async def bombs(self) -> None:
        # One bomb a round, in turn: while they still stall the server, each round takes
        # its read timeout, and all of them in one round would never get past the first.
        number = self.t.outcomes["rounds"] % len(BOMBS)
        self.t.doing = f"bomb{number}"
        await self.bomb(number, BOMBS[number])

    async def lists(self) -> None:
        """Six filtered lists at once, none of them matching anything: each read every
        stored run of the tenant (issue 24 row 13); they read their own index now."""
        queries = ["workflowId=none", "status=failed", "workflowId=quick&status=paused"] * 2
        started = time.monotonic()
        answers = await asyncio.gather(
            *(self.client.get(f"/api/executions?{query}") for query in queries)
        )
        took = time.monotonic() - started
        self.t.took("six filtered lists", took)
        if any(answer.status_code != 200 for answer in answers):
            self.find(f"a filtered list answered {[a.status_code for a in answers]}")
        elif took > FAST:
            self.find(f"six filtered lists took {took:.2f} s")
        else:
            self.t.outcomes["lists fast"] += 1

    async def refs(self) -> None:
        for ref in (f"http://127.0.0.1:{self.port}/x.json", "file:///etc/passwd"):
            schema = {"type": "object", "properties": {"x": {"$ref": ref}}}
            began = time.monotonic()
            response = await put(self.client, approval("ref", schema))
            self.t.took("ref_put", time.monotonic() - began)
            if response.status_code != 422:
                self.find(f"$ref {ref} answered {response.status_code} at PUT, not 422")
            elif "root:" in response.text:
                self.find(f"$ref {ref}: the 422 carries a local file's content")
            else:
                self.t.outcomes["ref 422"] += 1

    async def redos(self) -> None:
        started = await self.client.post("/api/workflows/redos/execute", json={})
        if started.status_code != 202:
            self.find(f"redos execute answered {started.status_code}")
            return
        execution_id = started.json()["executionId"]
        if not await until_paused(self.client, execution_id, deadline=10):
            self.find(f"{execution_id}: redos never paused")
            return
        began = time.monotonic()
        evil = {"input": "a" * 40 + "!"}
        response = await self.client.post(f"/api/executions/{execution_id}/resume", json=evil)
        seconds = time.monotonic() - began
        self.t.took("redos_resume", seconds)
        if response.status_code != 422:
            self.find(f"{execution_id}: catastrophic pattern answered {response.status_code}")
        elif seconds > FAST:
            self.find(f"catastrophic pattern took {seconds:.2f}s to refuse (limit {FAST}s)")
        else:
            self.t.outcomes["redos 422"] += 1
        await self.client.post(f"/api/executions/{execution_id}/cancel")

    async def stored_fast(self, what: str, workflow: dict[str, Any]) -> bool:
        """PUT a template workflow: stored (nothing evaluated) within FAST seconds."""
        before = rss(self.t.server.pid)
        began = time.monotonic()
        response = await put(self.client, workflow)
        seconds = time.monotonic() - began
        grown = rss(self.t.server.pid) - before
        self.t.took(f"{what}_put", seconds)
        if response.status_code not in (200, 201):
            self.find(f"{what}: PUT answered {response.status_code}: {response.text[:200]}")
            return False
        if seconds > FAST:
            self.find(f"{what}: PUT took {seconds:.2f}s (limit {FAST}s)")
        if grown > FOLD_GROWTH:
            self.find(f"{what}: one PUT grew the server by {grown // MIB} MiB")
        return True

    async def fails(self, what: str, workflow_id: str) -> None:
        """Run it: the execution must end failed, by its block, within a few seconds."""
        started = await self.client.post(f"/api/workflows/{workflow_id}/execute", json={})
        if started.status_code != 202:
            self.find(f"{what}: execute answered {started.status_code}")
            return
        began = time.monotonic()
        snapshot = await wait_terminal(self.client, started.json()["executionId"], deadline=20)
        self.t.took(f"{what}_run", time.monotonic() - began)
        if snapshot is None:
            self.find(f"{what}: the run did not end within 20 s")
        elif snapshot["status"] != "failed":
            self.find(f"{what}: the run ended {snapshot['status']}, not failed")
        else:
            self.t.outcomes[f"{what} failed"] += 1

    async def fold(self) -> None:
        if await self.stored_fast("fold", transform("fold", FOLD)):
            await self.fails("fold", "fold")

    async def bomb(self, number: int, template: str) -> None:
        if await self.stored_fast(f"bomb{number}", transform(f"bomb{number}", template)):
            await self.fails(f"bomb{number}", f"bomb{number}")

    async def nested(self) -> None:
        """Each nested shape, as a template and as a ``when``: 422 naming both paths."""
        for expression in NESTED:
            blocks = [
                {"id": "a", "type": "transform", "config": {"value": "{{ " + expression + " }}"}},
                {"id": "b", "type": "transform", "config": {"value": 1}},
            ]
            workflow = {
                "id": "deep",
                "blocks": blocks,
                "edges": [{"from": "a", "to": "b", "when": expression}],
            }
            began = time.monotonic()
            response = await put(self.client, workflow)
            self.t.took("nested_put", time.monotonic() - began)
            paths = (
                {p["path"] for p in response.json()["error"].get("problems", [])}
                if response.status_code == 422
                else set()
            )
            if not {"$.blocks[0].config.value", "$.edges[0].when"} <= paths:
                self.find(
                    f"a nested template answered {response.status_code}: {response.text[:200]}"
                )
            else:
                self.t.outcomes["nested 422"] += 1

    async def repeat(self) -> None:
        """A config that renders a 1 MB input 300 times: the block fails, nothing built
        (the scenario's memory bound holds the server's growth)."""
        started = await self.client.post(
            "/api/workflows/repeat/execute", json={"input": {"s": "z" * 1_000_000}}
        )
        if started.status_code != 202:
            self.find(f"repeat: execute answered {started.status_code}")
            return
        snapshot = await wait_terminal(self.client, started.json()["executionId"], deadline=20)
        if snapshot is None or snapshot["status"] != "failed":
            self.find(f"repeat: the run ended {snapshot and snapshot['status']}, not failed")
        else:
            self.t.outcomes["repeat failed"] += 1

    async def echo(self) -> None:
        """A 10 MB input echoed by a one-block ``transform``: it held the event loop ~10 s
        (issue 24 row 1); the run fails with the bound's error, the loop is not held."""
        started = await self.client.post(
            "/api/workflows/quick/execute",
            content=zeros_body(),
            headers={"content-type": "application/json"},
        )
        if started.status_code != 202:
            self.find(f"echo: execute answered {started.status_code}")
            return
        snapshot = await wait_terminal(self.client, started.json()["executionId"], deadline=20)
        if snapshot is None or snapshot["status"] != "failed":
            self.find(f"echo: the run ended {snapshot and snapshot['status']}, not failed")
        else:
            self.t.outcomes["echo failed"] += 1

    async def keyless(self) -> None:
        """A keyless request announcing a 10 MiB body: 401 before a byte of it is read."""
        self.report.requests += 1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.t.server.port)
        try:
            writer.write(
                b"POST /api/workflows/quick/execute HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 10485760\r\n\r\n[{},"
            )
            await writer.drain()
            async with asyncio.timeout(FAST * 4):
                head = await reader.readuntil(b"\r\n\r\n")
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            self.find(f"a keyless 10 MiB body: {type(exc).__name__} instead of a 401")
            return
        finally:
            writer.close()
        if head.startswith(b"HTTP/1.1 401"):
            self.t.outcomes["keyless 401"] += 1
        else:
            self.find(f"a keyless 10 MiB body got {head[:60]!r}")

    async def short_secret(self) -> None:
        """A secret under 8 characters would mask every ``api`` in other tenants' logs."""
        response = await self.client.put("/api/secrets/SHORT", json={"value": "api"})
        if response.status_code == 422:
            self.t.outcomes["short secret 422"] += 1
        else:
            self.find(f"a 3-character secret answered {response.status_code}")

    async def hoard(self) -> None:
        """The hoarder fills its quota (the first round), then is refused one more
        workflow and one execution each round: 429 ``storage_quota``, nothing of either
        written; the other tenants go on meanwhile (their rules above)."""
        if not self.hoarded:
            if await self.fill():
                self.t.outcomes["hoard full"] += 1
                await self.beside_the_full_hoarder()
            return
        hoarder = self.t.hoarder
        more = f"hoard{len(self.hoarded)}"
        if self.refused_for_quota("a workflow", await put(hoarder, transform(more, "h"))):
            self.t.outcomes["hoard workflow 429"] += 1
            if (await hoarder.get(f"/api/workflows/{more}")).status_code != 404:
                self.find(f"the hoarder's refused workflow {more} was stored")
        started = await hoarder.post(f"/api/workflows/{self.hoarded[0]}/execute", json={})
        if self.refused_for_quota("an execution", started):
            self.t.outcomes["hoard execution 429"] += 1
            listed = (await hoarder.get("/api/executions?limit=1")).json()["executions"]
            if listed:
                self.find(f"the hoarder's refused execution was created: {listed}")

    async def fill(self) -> bool:
        """Store ``HOARD``-byte workflows until one is refused, then halve the size until
        a one-byte one is refused: no room is left for anything; True once full."""
        size = HOARD
        while size:
            number = len(self.hoarded)
            if number > self.quota // HOARD + 32:
                self.find(f"the hoarder stored {number} workflows, a quota of {self.quota} bytes")
                return False
            workflow = transform(f"hoard{number}", "h" * size)
            began = time.monotonic()
            response = await put(self.t.hoarder, workflow)
            self.t.took("hoard_put", time.monotonic() - began)
            if response.status_code in (200, 201):
                self.hoarded.append(workflow["id"])
            elif self.refused_for_quota("a workflow", response):
                size //= 2
            else:
                return False
        return bool(self.hoarded)

    async def beside_the_full_hoarder(self) -> None:
        """The well-behaved tenant still stores a new workflow once the hoarder is full."""
        response = await put(self.t.good, {**GOOD_WORKFLOW, "id": "polite-too"})
        if response.status_code in (200, 201):
            self.t.outcomes["good put beside the full hoarder"] += 1
        else:
            self.find(f"good: a PUT beside the full hoarder answered {response.status_code}")

    def refused_for_quota(self, what: str, response: httpx.Response) -> bool:
        """``response`` is 429 ``storage_quota`` with Retry-After and the quota's figures
        (a finding if not)."""
        error = response.json().get("error", {}) if response.status_code == 429 else {}
        if (
            error.get("code") != "storage_quota"
            or error.get("limitBytes") != self.quota
            or not response.headers.get("retry-after")
        ):
            self.find(
                f"the hoarder's {what} past its quota answered {response.status_code}: "
                f"{response.text[:200]}"
            )
            return False
        return True

    async def token(self) -> None:
        """Follow a finished execution with its stream token under another spelling of
        ``token``: accepted, and the token must never reach the log."""
        started = await self.client.post("/api/workflows/quick/execute", json={"input": 1})
        if started.status_code != 202:
            self.find(f"token: execute answered {started.status_code}")
            return
        body = started.json()
        spelling = TOKEN_SPELLINGS[len(self.t.tokens) % len(TOKEN_SPELLINGS)]
        self.t.tokens.append(body["streamToken"])
        view = View(body["executionId"])
        url = f"/api/executions/{view.execution_id}/stream?{spelling}={body['streamToken']}"
        async with self.t.anonymous.stream(
            "GET", url, headers={"Accept": "text/event-stream"}
        ) as r:
            await r.aread()
            if r.status_code == 200 and "execution:completed" in r.text:
                self.t.outcomes["token stream"] += 1
            else:
                self.find(f"?{spelling}= stream answered {r.status_code}: {r.text[:200]}")

    async def caps(self) -> None:
        """Pause executions past the cap, then open streams past the cap: 429 with
        Retry-After each time, never more than CAP accepted; then let them all go."""
        paused: list[str] = []
        try:
            for _ in range(CAP + 3):
                response = await self.client.post("/api/workflows/hold/execute", json={})
                if response.status_code == 202:
                    paused.append(response.json()["executionId"])
                    continue
                if response.status_code != 429 or not response.headers.get("retry-after"):
                    self.find(
                        f"execute past the cap answered {response.status_code} "
                        f"(Retry-After {response.headers.get('retry-after')})"
                    )
                else:
                    self.t.outcomes["executions 429"] += 1
                break
            else:
                self.find(f"{CAP + 3} executions accepted with a cap of {CAP}")
            if len(paused) > CAP:
                self.find(f"{len(paused)} executions accepted with a cap of {CAP}")
            if paused:
                await until_paused(self.client, paused[-1], deadline=10)
                self.t.doing = "caps: streams"
                await self.streams(paused)
        finally:
            self.t.doing = "caps: cancels"
            for execution_id in paused:
                await self.client.post(f"/api/executions/{execution_id}/cancel")

    async def streams(self, paused: list[str]) -> None:
        headers = {"Accept": "text/event-stream"}
        async with contextlib.AsyncExitStack() as held:
            for number in range(CAP + 3):
                url = f"/api/executions/{paused[number % len(paused)]}/stream"
                response = await held.enter_async_context(
                    self.client.stream("GET", url, headers=headers)
                )
                if response.status_code == 200:
                    continue
                await response.aread()
                if response.status_code != 429 or not response.headers.get("retry-after"):
                    self.find(f"stream past the cap answered {response.status_code}")
                else:
                    self.t.outcomes["streams 429"] += 1
                if number < CAP:
                    self.find(f"stream refused at {number} open, below the cap of {CAP}")
                return
            self.find(f"{CAP + 3} streams open with a cap of {CAP}")

    async def trickle(self) -> None:
        """A PUT whose body arrives a byte every half second: 408 and closed."""
        body = json.dumps(transform("trickle", "{{ input }}")).encode()
        self.report.requests += 1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.t.server.port)
        writer.write(
            b"PUT /api/workflows/trickle HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {HOSTILE}\r\n".encode()
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        answer = b""
        began = time.monotonic()
        answered: float | None = None
        closed = False
        try:
            async with asyncio.timeout(BODY_TIMEOUT + 3):
                for byte in body:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        answer += await asyncio.wait_for(reader.read(4096), 0.5)
                    if answer:
                        answered = time.monotonic() - began
                        break
            # "Answered 408 and closed": the server must not wait for the rest of the body.
            try:
                async with asyncio.timeout(CLOSE_WITHIN):
                    while chunk := await reader.read(4096):
                        answer += chunk
                    closed = True
            except ConnectionResetError:
                # Closed too: a byte of ours reached the server after it closed, and its
                # kernel answered with a reset instead of the end of the stream. (Read as
                # "left open", this was the hostile-tenant flake of busy full runs.)
                closed = True
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
        if answered is None or not answer.startswith(b"HTTP/1.1 408"):
            self.find(f"a trickling body got {answer[:60]!r} after {time.monotonic() - began:.1f}s")
            return
        self.t.took("trickle_408", answered)
        self.t.outcomes["trickle 408"] += 1
        if not closed:
            self.t.outcomes["trickle left open"] += 1
            self.find(
                f"a trickling body got 408 (after ~{BODY_TIMEOUT:g}s), but the connection "
                f"stayed open over {CLOSE_WITHIN:g}s after it "
                f"(answer has Connection: close: {b'connection: close' in answer.lower()})"
            )


# -- the well-behaved tenant -----------------------------------------------------------


class Polite:
    """Small executions and plain GETs at a steady rate, every request timed. It runs in
    a thread with its own event loop and client, so the hostile client's work in the
    main loop does not count as the server's delay."""

    def __init__(self, t: Tenants, report: Report) -> None:
        self.t, self.report = t, report
        self.views: list[View] = []

    async def main(self, seconds: float) -> None:
        async with self.t.client(GOOD) as self.client:
            await self.load(seconds)

    async def timed(self, method: str, url: str, **kwargs: Any) -> httpx.Response | None:
        """The answer, timed; None (and a finding) if the server did not answer."""
        began = time.monotonic()
        doing = self.t.doing
        try:
            response = await self.client.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            self.report.find(f"good: {method} {url} during {doing}: {type(exc).__name__}")
            response = None
        seconds = time.monotonic() - began
        self.t.latencies.append(seconds)
        if seconds > P99_LIMIT:
            self.t.slow[f"{method} during {doing}"] += 1
        return response

    async def run(self, group: asyncio.TaskGroup, number: int) -> None:
        response = await self.timed(
            "POST", "/api/workflows/polite/execute", json={"input": {"n": number}}
        )
        if response is None:
            return
        if response.status_code != 202:
            self.report.find(f"good: execute answered {response.status_code}")
            return
        view = View(response.json()["executionId"])
        self.views.append(view)
        group.create_task(follow([self.client], view, self.report, deadline=30))

    async def load(self, seconds: float) -> None:
        """A request every 50 ms, an execution every tenth."""
        stop = time.monotonic() + seconds
        async with asyncio.TaskGroup() as group:
            number = 0
            while time.monotonic() < stop:
                tick = time.monotonic()
                if number % 10 == 0:
                    await self.run(group, number)
                elif number % 3 == 0 and self.views:
                    await self.timed("GET", f"/api/executions/{self.views[-1].execution_id}")
                elif number % 3 == 1:
                    await self.timed("GET", "/api/workflows/polite")
                else:
                    await self.timed("GET", "/api/workflows")
                number += 1
                await asyncio.sleep(max(0.0, 0.05 - (time.monotonic() - tick)))


# -- the scenario ----------------------------------------------------------------------


async def hostile_tenant(
    root: Path, *, long: bool = False, seed: int = 0, include_templates: bool = True
) -> Report:
    """A hostile tenant loops over every payload of issue 13 beside a well-behaved one."""
    del seed  # the plan is fixed: every round sends every payload
    seconds = 300 if long else 15
    quota = LONG_QUOTA if long else QUOTA
    report = Report(
        "hostile-tenant", Budget(seconds=seconds + 60, requests=int(seconds * 250) + 500)
    )
    listener = Listener()
    listening = await asyncio.start_server(listener.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        async with tenants(root, report, quota) as t:
            hostile = Hostile(t, report, port, include_templates, quota)
            polite = Polite(t, report)
            await hostile.prepare()
            (await put(t.good, GOOD_WORKFLOW)).raise_for_status()
            pid = t.server.pid
            baseline = rss(pid)
            peak = baseline
            stop = asyncio.Event()

            async def sample() -> None:
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, rss(pid))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.1)

            async def rounds() -> None:
                while not stop.is_set():
                    await hostile.round()
                    t.outcomes["rounds"] += 1

            async def trickles() -> None:
                while not stop.is_set():
                    await hostile.trickle()

            async def load() -> None:
                async with asyncio.TaskGroup() as group:
                    group.create_task(sample())
                    workers = [group.create_task(rounds()), group.create_task(trickles())]
                    await asyncio.to_thread(asyncio.run, polite.main(seconds))
                    stop.set()
                    await asyncio.gather(*workers)

            # The good tenant alone first: what its p99 is on this machine right now.
            await asyncio.to_thread(asyncio.run, polite.main(QUIET_SECONDS))
            quiet = percentile(t.latencies, 0.99)
            t.latencies.clear()
            await bounded(report, load())
            peak = max(peak, rss(pid, "VmHWM"))
            conclude(report, t, baseline, peak, quiet)
            for view in polite.views:
                log = await stored_log(t.good, view.execution_id)
                report.stored_events += len(log)
                verify(report, log, [view])
                check_work(report, log, GOOD_WORKFLOW)
            report.executions = len(polite.views)
        token_leaks = [token for token in t.tokens if token in t.server.logs()]
        redacted = t.server.logs().count("=[redacted]")
        report.figures["token_lines_redacted"] = redacted
        if token_leaks:
            report.find(f"{len(token_leaks)} of {len(t.tokens)} stream tokens in the server log")
        elif t.tokens and not redacted:
            report.find("no access-log line carries a redacted token: redaction went unchecked")
    finally:
        listening.close()
        await listening.wait_closed()
    if listener.hits:
        report.find(f"the $ref listener saw {listener.hits} connections")
    report.figures["ref_fetches"] = listener.hits
    return report


def conclude(report: Report, t: Tenants, baseline: int, peak: int, quiet: float) -> None:
    """The figures, and the rules on the good tenant's latency (against ``quiet``, its
    p99 alone on this machine in this run) and the server's memory."""
    p50, p99 = percentile(t.latencies, 0.5), percentile(t.latencies, 0.99)
    limit = max(P99_LIMIT, QUIET_RATIO * quiet + QUIET_MARGIN)
    report.figures.update(
        good_quiet_p99_ms=round(quiet * 1000, 1),
        good_p99_limit_ms=round(limit * 1000, 1),
        good_requests=len(t.latencies),
        good_p50_ms=round(p50 * 1000, 1),
        good_p99_ms=round(p99 * 1000, 1),
        good_max_ms=round(max(t.latencies, default=0) * 1000, 1),
        rss_baseline_mib=baseline // MIB,
        rss_peak_mib=peak // MIB,
        rss_bound_mib=(baseline + RSS_ALLOWANCE) // MIB,
        hostile=dict(t.outcomes),
        slowest_s=t.slowest,
        good_slow=dict(t.slow),
    )
    if p99 > limit:
        report.find(
            f"good: request p99 {p99 * 1000:.0f} ms over {limit * 1000:.0f} ms "
            f"(alone first: p99 {quiet * 1000:.0f} ms) "
            f"(p50 {p50 * 1000:.0f} ms, {len(t.latencies)} requests, "
            f"mean {statistics.fmean(t.latencies) * 1000:.0f} ms)"
        )
    if peak > baseline + RSS_ALLOWANCE:
        report.find(
            f"server RSS peaked at {peak // MIB} MiB, over the bound "
            f"{(baseline + RSS_ALLOWANCE) // MIB} MiB (baseline {baseline // MIB} MiB)"
        )
