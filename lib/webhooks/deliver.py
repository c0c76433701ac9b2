"""Delivering webhooks: every process that runs work runs a ``Deliverer`` (SPEC §15).

It does two things in one loop, off the executions' path:

- looks at the hints the event writers left (outbox.py): a stored event some webhook
  wants becomes owed deliveries, built from the stored event (the store is the truth);
- attempts the deliveries due, at most ``concurrency`` at once in this process, and at
  most half of them for one tenant (tenants are served in turn, least recently served
  first), each attempt bounded by its timeout (``FLOWCAST_WEBHOOK_TIMEOUT_SECONDS``). Its own
  tasks and its own HTTP client: a slow receiver costs only its own attempt, never a
  worker slot or an execution's time.

An attempt is answered 2xx: delivered. 410: failed, never retried. Anything else (an
error, a timeout, a refused address): retried after the next delay of the schedule
(``FLOWCAST_WEBHOOK_RETRY_SECONDS``); failed once it is spent. The same ``webhook-id``
(``<executionId>.<eventId>``) goes with every attempt, and a fresh timestamp and
signature.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
from redis.asyncio import Redis

from lib.backoff import Backoff
from lib.errors import BlockError, BufferUnavailable
from lib.execution.events import STATUS_AFTER, TERMINAL_STATUSES
from lib.execution.record import Field
from lib.metrics import Metrics
from lib.tasks import stop
from lib.webhooks.outbox import DELIVERED, FAILED, PENDING, Delivery, Outbox
from lib.webhooks.signing import WebhookSecrets, sign
from lib.webhooks.spec import decoded
from lib.workflows.blocks.base import IPAddress, Resolver
from lib.workflows.blocks.http import allowed_addresses, shown, system_resolver

log = logging.getLogger(__name__)

ATTEMPT_SECONDS = 10.0
# How long past an attempt's timeout its delivery stays leased. A process that dies
# mid-attempt leaves it due again after the timeout and this margin.
LEASE_MARGIN_MS = 2_000
# How long a hint looked at stays leased (materializing it is a few reads); a hint whose
# event is not stored yet (its writer may be retrying through an outage) is looked at
# again after this.
HINT_LEASE_MS = 1_000
# The loop polls nothing: it waits until the earliest hint or delivery is due (outbox.lua
# "next"), or for a wake: a hint, a delivery owed or a retry scheduled anywhere
# (published on the outbox's wake channel, which this process's tails subscribe to and
# hand over as ``wake``), an attempt ended here, a (re)subscription (a publish may have
# been missed). Nothing due: this long at most, in case a wake went missing all the same.
IDLE_SECONDS = 30.0
# While the outbox is unreachable: the first wait, and the longest.
OUTAGE_FIRST_WAIT_SECONDS = 0.25
OUTAGE_WAIT_SECONDS = 5.0
# While a delivery is due that this process may not start (its tenant has its share of
# the attempt slots here): an attempt that ends wakes the loop; this long at most, for
# the other tenants' deliveries that fall due meanwhile ("next" says the held one is due
# now, and the loop waited 0 s and asked again: 1,000 turns a second).
HELD_WAIT_SECONDS = 0.25
MAX_ANSWER_CHARS = 200
# At most this much of an answer is read (UTF-8: 200 characters fit in 800 bytes).
MAX_ANSWER_BYTES = 4 * MAX_ANSWER_CHARS


class Deliverer:
    """Turns hints into deliveries and attempts the due ones, while entered."""

    def __init__(
        self,
        *,
        redis: Redis,
        outbox: Outbox,
        secrets: WebhookSecrets,
        retry_seconds: Sequence[float],
        allow_private: bool,
        concurrency: int = 16,
        timeout_seconds: float = ATTEMPT_SECONDS,
        metrics: Metrics | None = None,
        resolve: Resolver | None = None,
        prefix: str = "fc",
        wake: asyncio.Event | None = None,
    ) -> None:
        self._redis = redis
        self._outbox = outbox
        self._secrets = secrets
        self._retry = list(retry_seconds)
        self._allow_private = allow_private
        self._timeout = timeout_seconds
        self._lease_ms = int(timeout_seconds * 1000) + LEASE_MARGIN_MS
        self._per_tenant = max(1, concurrency // 2)
        self._metrics = metrics
        self._resolve = resolve or system_resolver
        self._prefix = prefix
        self._busy: dict[str, int] = {}
        self._served: dict[str, float] = {}
        self._room = asyncio.Semaphore(concurrency)
        # Set by this process's tails on a hint written anywhere (``wake`` channel).
        self._wake = wake or asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._attempts: set[asyncio.Task[None]] = set()
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)

    async def __aenter__(self) -> Deliverer:
        self._task = asyncio.create_task(self._run(), name="webhooks")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # ``stop`` cancels again a loop whose cancel a Redis call dropped (lib/tasks.py):
        # awaited after one cancel, the loop ran on and the shutdown waited for it for
        # good, renewing the leases of runs it never handed off (servers that did not
        # stop within 30 s in a CI run, and a hand-off nobody took).
        await stop(self._task)
        # An attempt cut short stays leased: another process makes it again.
        await stop(*self._attempts)
        await self._client.aclose()

    def nudge(self) -> None:
        """Look now (a hint was just written here)."""
        self._wake.set()

    async def _run(self) -> None:
        # While Redis is unreachable: one warning, then growing waits (the executions'
        # own writers report the outage too).
        backoff = Backoff(base=OUTAGE_FIRST_WAIT_SECONDS, cap=OUTAGE_WAIT_SECONDS)
        failing = False
        while True:
            # Cleared before this turn looks, never after: a wake set while it looks (a
            # publish heard as "next" answers) is one its answer may not include, and
            # cleared after, the loop slept IDLE_SECONDS with a delivery due.
            self._wake.clear()
            try:
                await self._look()
                held = await self._take()
                wait = await self._next_wait(held)
            except BufferUnavailable as exc:
                if not failing:
                    log.warning("webhook outbox unreachable; will retry", extra={"error": str(exc)})
                failing = True
                await backoff.wait()
                continue
            except Exception:
                log.exception("webhook delivery loop failed; carrying on")
                wait = OUTAGE_FIRST_WAIT_SECONDS  # none computed (the first turn died)
            if failing:
                log.info("webhook outbox reachable again")
                failing = False
                backoff.reset()
            # A tick instead of a timeout around the wait, as dispatch.py waits: a cancel
            # that lands as such a timeout fires can come out as the timeout.
            tick = asyncio.get_running_loop().call_later(wait, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                tick.cancel()

    async def _next_wait(self, held: bool) -> float:
        """How long to wait unless woken: until the earliest hint or delivery is due;
        while every attempt slot is busy, until one ends (it wakes the loop); while a
        delivery is due that ``held`` back (its tenant at its share), not less than
        ``HELD_WAIT_SECONDS``."""
        if self._room.locked():
            return IDLE_SECONDS
        due_ms = await self._outbox.next_ms()
        wait = IDLE_SECONDS if due_ms < 0 else min(due_ms / 1000, IDLE_SECONDS)
        return max(wait, HELD_WAIT_SECONDS) if held else wait

    # -- hints -> deliveries ---------------------------------------------------------

    async def _look(self) -> None:
        for execution_id, event_id in await self._outbox.look(HINT_LEASE_MS):
            await self.materialize(execution_id, event_id)

    async def materialize(self, execution_id: str, event_id: int) -> None:
        """Owe the deliveries of a hinted event once it is stored; drop the hint when it
        never will be (leave it, to be looked at again, while it may)."""
        meta_key = f"{self._prefix}:{{{execution_id}}}:meta"
        stream_key = f"{self._prefix}:{{{execution_id}}}:events"
        names = [Field.TENANT, Field.WORKFLOW_ID, Field.CREATED_AT, Field.UPDATED_AT,
                 Field.LAST_ID, Field.STATUS, Field.WEBHOOKS]  # fmt: skip
        try:
            values: list[Any] = await self._redis.hmget(meta_key, [str(name) for name in names])
            entries: Any = await self._redis.xrange(
                stream_key, f"{event_id}-0", f"{event_id}-0", count=1
            )
        except Exception as exc:
            raise BufferUnavailable(f"cannot read execution {execution_id}: {exc}") from exc
        tenant, workflow_id, created, updated, last, status, hooks_raw = (
            v.decode() if v is not None else None for v in values
        )
        if tenant is None:
            await self._outbox.drop_hint(execution_id, event_id)  # gone (expired)
            return
        if not entries:
            if int(last or 0) >= event_id or status in TERMINAL_STATUSES:
                await self._outbox.drop_hint(execution_id, event_id)  # never stored
            return  # not stored yet: looked at again after the hint's lease
        fields = entries[0][1]
        envelope = orjson.loads(fields[b"e"])
        event_type = envelope.get("type", "")
        hooks = decoded(hooks_raw)
        wanted = {i: hook for i, hook in enumerate(hooks) if event_type in hook.events}
        if not wanted:
            await self._outbox.drop_hint(execution_id, event_id)
            return
        body = orjson.dumps(
            {
                **envelope,
                "execution": {
                    "id": execution_id,
                    "workflowId": workflow_id,
                    "status": STATUS_AFTER.get(event_type, "running"),
                    "createdAt": created,
                    "updatedAt": envelope.get("ts") or updated,
                },
            }
        )
        now = time.time()
        states = {
            i: {
                "url": shown(httpx.URL(hook.url)),
                "event": event_type,
                "eventId": event_id,
                "webhookId": f"{execution_id}.{event_id}",
                "state": PENDING,
                "attempts": 0,
                "lastAnswer": None,
                "owedAt": now,
                "hook": hook.url,
            }
            for i, hook in wanted.items()
        }
        await self._outbox.owe(tenant, execution_id, event_id, states, body)
        self._wake.set()

    # -- attempts --------------------------------------------------------------------

    async def _take(self) -> bool:
        """Start attempts while there is room, serving the tenants in turn. True when
        it stopped with deliveries due that it may not start (their tenants at their
        share of the slots here)."""
        while not self._room.locked():
            tenants = await self._outbox.due_tenants()
            # Only the tenants with work due are remembered (this process may see many).
            self._served = {t: at for t, at in self._served.items() if t in tenants}
            ready = [t for t in tenants if self._busy.get(t, 0) < self._per_tenant]
            if not ready:
                return bool(tenants)
            ready.sort(key=lambda t: self._served.get(t, 0.0))
            started = False
            for tenant in ready:
                if self._room.locked():
                    return False
                delivery = await self._outbox.take(tenant, self._lease_ms)
                if delivery is None:
                    continue
                await self._room.acquire()
                self._busy[tenant] = self._busy.get(tenant, 0) + 1
                self._served[tenant] = time.monotonic()
                task = asyncio.create_task(self._attempt(delivery), name="webhook attempt")
                self._attempts.add(task)
                task.add_done_callback(self._attempts.discard)
                started = True
                break  # re-read: tenants served in turn
            if not started:
                return len(ready) < len(tenants)
        return False

    async def _attempt(self, delivery: Delivery) -> None:
        try:
            await self.attempt(delivery)
        except Exception:
            log.exception("webhook attempt failed", extra={"executionId": delivery.execution_id})
        finally:
            self._room.release()
            self._busy[delivery.tenant] -= 1
            if not self._busy[delivery.tenant]:
                del self._busy[delivery.tenant]
            self._wake.set()

    async def attempt(self, delivery: Delivery) -> None:
        """One attempt of a leased delivery, and its outcome recorded."""
        found = await self._outbox.read(delivery)
        if found is None:
            await self._outbox.settle(delivery, {}, None)
            return
        state, body = found
        if state.get("state") != PENDING:
            await self._outbox.settle(delivery, state, None)  # settled by another attempt
            return
        answer, status = await self._post(delivery, state["hook"], body)
        attempts = int(state.get("attempts", 0)) + 1
        retry_ms: int | None = None
        if status is not None and 200 <= status < 300:
            outcome = DELIVERED
        elif status == 410 or attempts > len(self._retry):
            outcome = FAILED
        else:
            outcome = PENDING
            retry_ms = int(self._retry[attempts - 1] * 1000)
        state.update(
            state=outcome,
            attempts=attempts,
            lastAnswer=answer,
            nextAttemptInSeconds=None if retry_ms is None else retry_ms / 1000,
        )
        await self._outbox.settle(delivery, state, retry_ms)
        if self._metrics is not None:
            self._metrics.webhook_attempts.labels(
                outcome="ok" if outcome == DELIVERED else "error"
            ).inc()
            if outcome != PENDING:
                self._metrics.webhook_deliveries.labels(outcome=outcome).inc()
        log.info(
            "webhook attempt",
            extra={
                "executionId": delivery.execution_id,
                "webhookId": delivery.webhook_id,
                "attempt": attempts,
                "outcome": outcome,
                "status": status,
            },
        )

    async def _post(
        self, delivery: Delivery, url: str, body: bytes
    ) -> tuple[dict[str, Any], int | None]:
        """POST once; the answer as the snapshot shows it, and the status (None: none)."""
        at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        timestamp = int(time.time())
        secrets = (await self._secrets.get(delivery.tenant)).signing()
        headers = {
            "content-type": "application/json",
            "user-agent": "Flowcast-Webhooks",
            "accept-encoding": "identity",  # the answer's start is read as it comes
            "webhook-id": delivery.webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(
                sign(secret, delivery.webhook_id, timestamp, body) for secret in secrets
            ),
        }
        try:
            async with asyncio.timeout(self._timeout):
                target, extensions = await self._pinned(httpx.URL(url), headers)
                request = self._client.build_request(
                    "POST", target, content=body, headers=headers, extensions=extensions,
                    timeout=self._timeout,
                )  # fmt: skip
                # Only the start of the answer is read (the snapshot keeps that much): a
                # receiver's endless or huge body costs neither memory nor the outcome.
                response = await self._client.send(request, stream=True)
                try:
                    start = b""
                    async for chunk in response.aiter_raw():
                        start += chunk
                        if len(start) >= MAX_ANSWER_BYTES:
                            break
                finally:
                    await response.aclose()
                text = start[:MAX_ANSWER_BYTES].decode("utf-8", "replace")[:MAX_ANSWER_CHARS]
        except TimeoutError:
            return {"at": at, "error": f"no answer within {self._timeout:g} s"}, None
        except BlockError as exc:
            return {"at": at, "error": exc.message}, None
        except httpx.HTTPError as exc:
            message = str(exc) or type(exc).__name__
            return {"at": at, "error": message[:MAX_ANSWER_CHARS]}, None
        return {"at": at, "status": response.status_code, "body": text}, response.status_code

    async def _pinned(
        self, url: httpx.URL, headers: dict[str, str]
    ) -> tuple[httpx.URL, dict[str, Any]]:
        """The URL to send to: as it is when private addresses are allowed, else pinned
        to an address checked now (the ``http`` block's rule; a name that resolves
        elsewhere than when it was stored is caught here)."""
        if self._allow_private:
            return url, {}
        addresses: list[IPAddress] = await allowed_addresses(url, self._resolve, self._timeout)
        address = addresses[0]
        headers["host"] = url.netloc.decode("ascii")
        extensions: dict[str, Any] = {}
        if url.scheme == "https":
            extensions["sni_hostname"] = url.raw_host.decode("ascii")
        return url.copy_with(host=str(address)), extensions
