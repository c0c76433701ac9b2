"""The one Redis seam: every key name, every error translation, every Lua script.

Every module that talks to Redis builds its keys with ``Keys`` and wraps its calls in
``translated`` (or ``translating``), so a Redis or cluster error becomes
``BufferUnavailable`` in exactly one way. Keys of one execution share the hash tag
``{<eid>}`` so its scripts run on Redis Cluster; the few global keys (the lease and
deadline watch lists, tenants' indexes) are only ever touched one key per command.

Scripts are registered with ``register``: it puts the shared prelude
(``lib/execution/prelude.lua``: ``now_ms`` and the other helpers scripts share) in front
of the script's own text. Every key and channel a script touches comes in as ``KEYS``
or ``ARGV``, built here by ``Keys``; no script builds a name.
"""

from __future__ import annotations

import functools
import importlib.resources
import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from lib.errors import BufferUnavailable

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

P = ParamSpec("P")
T = TypeVar("T")


class Keys:
    """Names of every Redis key Flowcast uses, under one prefix."""

    def __init__(self, prefix: str = "fc") -> None:
        self.prefix = prefix
        self.leases = f"{prefix}:leases"  # running executions by lease end ("<eid> <fence>")
        self.deadlines = f"{prefix}:deadlines"  # paused executions by approval deadline
        self.store = f"{prefix}:store"  # which Redis server wrote the data (store.lua)
        # Executions let go by a shutdown, for any process to take over; read in one
        # blocking read with each process's control stream (same hash tag).
        self.handoffs = f"{prefix}:{{control}}:handoffs"
        # A pub/sub channel, not a key: append.lua publishes each execution id it
        # stored events of, and every process's readers wake on it.
        self.notify = f"{prefix}:notify"
        # A pub/sub channel too: start.lua and append.lua publish an execution's list
        # row each time its status changes, for the live lists (listing.py).
        self.status = f"{prefix}:status"
        # The fair queue (queue.lua): the tenants with queued work by virtual time, the
        # clock and weights, and the deliveries taken and not yet claimed.
        self.waiting = f"{prefix}:{{queue}}:tenants"
        self.fair = f"{prefix}:{{queue}}:fair"
        self.taken = f"{prefix}:{{queue}}:taken"
        # A stream every process reads with its control stream: "work is queued" or "a
        # slot freed", for the workers with free slots (control.py).
        self.queue_wake = f"{prefix}:{{control}}:queue"

    def events(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:events"

    def meta(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:meta"

    def dropped(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:dropped"

    def state(self, execution_id: str) -> str:
        return f"{self.prefix}:{{{execution_id}}}:state"

    def revoked(self, execution_id: str) -> str:
        """The fencing tokens of the execution's revoked deliveries (claim.lua
        "revoke"): a set, given its execution's TTL by every append (retention once it
        ended: it outlived its execution by the running TTL before)."""
        return f"{self.prefix}:{{{execution_id}}}:revoked"

    def execution(self, execution_id: str) -> list[str]:
        """The keys of one execution, in the order its scripts take them."""
        return [
            self.events(execution_id),
            self.meta(execution_id),
            self.dropped(execution_id),
            self.state(execution_id),
            self.revoked(execution_id),
        ]

    def index(self, tenant: str) -> str:
        """A tenant's executions by creation ms (every one of them)."""
        return f"{self.prefix}:executions:{tenant}"

    def listing(self, tenant: str, *, workflow_id: str | None, bucket: str | None) -> str:
        """The index a list with these filters reads (lib/execution/indexes.py): a
        tenant's executions of one workflow, in one status bucket, or both, by creation
        ms; the tenant's whole index without either. Index keys of one tenant share the
        hash tag ``{t:<tenant>}`` (the whole index keeps its older, untagged name)."""
        if workflow_id is None and bucket is None:
            return self.index(tenant)
        base = f"{self.prefix}:{{t:{tenant}}}:executions"
        if bucket is None:
            return f"{base}:workflow:{workflow_id}"
        if workflow_id is None:
            return f"{base}:{bucket}"
        # The bucket is one of a few fixed words without a colon: a workflow id that
        # contains one cannot make two of these names the same.
        return f"{base}:{bucket}:workflow:{workflow_id}"

    def indexed(self, tenant: str) -> str:
        """ "1" once the tenant's executions stored before the workflow and bucket
        indexes existed are listed in them too (indexes.complete)."""
        return f"{self.prefix}:{{t:{tenant}}}:indexed"

    def running(self, tenant: str) -> str:
        """A tenant's running ownerships and paused executions (admission.py), under the
        queue's hash tag: one step admits, queues and takes (queue.lua)."""
        return f"{self.prefix}:{{queue}}:running:{tenant}"

    def queued(self, tenant: str) -> str:
        """A tenant's queued executions, oldest first (queue.lua)."""
        return f"{self.prefix}:{{queue}}:queued:{tenant}"

    def node(self, node: str) -> str:
        """What a process runs, for the takers of its runs should it die (blame.py)."""
        return f"{self.prefix}:node:{node}"

    def control(self, node: str) -> str:
        return f"{self.prefix}:{{control}}:{node}"

    def workflows(self, tenant: str) -> str:
        return f"{self.prefix}:workflows:{tenant}"

    def workflow_version(self, digest: str) -> str:
        return f"{self.prefix}:workflow-version:{digest}"

    def idempotency(self, tenant: str, operation: str, name: str) -> str:
        return f"{self.prefix}:idem:{tenant}:{operation}:{name}"

    def secrets(self, tenant: str) -> str:
        return f"{self.prefix}:secrets:{tenant}"

    def quota(self, tenant: str) -> list[str]:
        """A tenant's storage ledger (quota.lua): the things it keeps, scored by when they
        stop counting, and their sizes with the total. Under the tenant's own hash tag
        ``{t:<tenant>}``, the tag every per-tenant key a script touches shares."""
        base = f"{self.prefix}:{{t:{tenant}}}:quota"
        return [base, f"{base}:bytes"]

    def slots(self, provider: str) -> list[str]:
        """One model provider's concurrency slots (slots.lua), under one hash tag."""
        base = f"{self.prefix}:{{llm:{provider}}}"
        return [
            f"{base}:{name}"
            for name in ("holders", "queue", "waiters", "fair", "freed", "pause", "store")
        ]


@contextmanager
def translating(action: str = "") -> Iterator[None]:
    """Turn Redis client errors raised inside into BufferUnavailable; ``action`` (e.g.
    "store the workflow") says what was being done."""
    doing = f" (trying to {action})" if action else ""
    try:
        yield
    except ResponseError as exc:
        raise BufferUnavailable(f"the buffer refused the command{doing}: {exc}") from exc
    # RedisClusterException is not a RedisError: the cluster client raises it when no
    # node answers or a slot has no node, and it must not escape the seam.
    except (RedisError, RedisClusterException, OSError) as exc:
        raise BufferUnavailable(f"the buffer is unreachable{doing}: {exc}") from exc
    except RuntimeError as exc:
        # A connection the server closed while the client wrote its handshake: the
        # event loop says so with a RuntimeError, not a connection error.
        if "closed" not in str(exc):
            raise
        raise BufferUnavailable(f"the buffer is unreachable{doing}: {exc}") from exc
    except AttributeError as exc:
        # A cluster client that gets CLUSTERDOWN (a restarted node serves its slots only
        # after about 2 s) closes every connection it holds, also those other commands
        # are connecting on: such a command fails inside the client with "'NoneType'
        # object has no attribute 'writelines'". A lost connection, not a bug here: it
        # escaped as such and ended the dispatcher's task, and a worker took no queued
        # execution again (a CI run under load).
        if not _raised_in_client(exc):
            raise
        raise BufferUnavailable(f"the buffer is unreachable{doing}: {exc!r}") from exc


def _raised_in_client(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the Redis client's own code (its innermost frame)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    return module == "redis" or module.startswith("redis.")


def translated(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Decorate a coroutine so Redis client errors leave it as BufferUnavailable."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        with translating():
            return await method(*args, **kwargs)

    return wrapper


def load_script(package: str, name: str) -> str:
    """The text of a Lua script that lives next to the module that runs it."""
    return importlib.resources.files(package).joinpath(name).read_text()


PRELUDE = ("lib.execution", "prelude.lua")


def script_source(package: str, name: str) -> str:
    """The text Redis runs for a script: the shared prelude, then the script's own."""
    prelude = load_script(*PRELUDE)
    body = load_script(package, name)
    if body.startswith("#!"):
        # The flags line (``#!lua flags=no-writes``) means something only as line one.
        flags, _, rest = body.partition("\n")
        return f"{flags}\n{prelude}\n{rest}"
    return f"{prelude}\n{body}"


def register(redis: Redis, package: str, name: str) -> AsyncScript:
    """Register a script (with the prelude) on ``redis``, once per client: calls then go
    by its SHA, loading the text only where a server does not know it yet."""
    return redis.register_script(script_source(package, name))


# What a command of a batch does with its reply once the batch is answered.
Then = Callable[[Any], Awaitable[None] | None]


class Batch:
    """Commands sent together in one round trip (a pipeline without a transaction; on a
    Cluster one per node, in parallel), for commands none of which needs another's
    answer. After the answer, each command's ``then`` runs in the order the commands
    were queued; the first to raise stops the rest.

    A server that forgot a script (restarted) answers NOSCRIPT: the batch loads its
    scripts and is sent once more, whole, so each command must bear being sent twice.
    """

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._calls: list[tuple[Sequence[Any], Then | None]] = []
        self._scripts: dict[str, str] = {}
        # The commands whose error reply goes to their ``then`` (``best_effort``).
        self._best_effort: set[int] = set()

    def call(self, *args: Any, then: Then | None = None, best_effort: bool = False) -> None:
        """Queue one command (its name and arguments). ``best_effort``: its error reply
        (on a cluster, also its node's failure) is handed to ``then`` (an exception)
        instead of failing the batch."""
        if best_effort:
            self._best_effort.add(len(self._calls))
        self._calls.append((args, then))

    def script(
        self,
        script: AsyncScript,
        keys: Sequence[Any],
        args: Sequence[Any],
        then: Then | None = None,
    ) -> None:
        """Queue one call of a registered script (``register``), by its SHA."""
        assert script.sha is not None
        self._scripts[script.sha] = script.script  # type: ignore[assignment]
        self.call("EVALSHA", script.sha, len(keys), *keys, *args, then=then)

    async def send(self) -> None:
        """Send the batch and hand each reply to its ``then``; BufferUnavailable when
        the server cannot be reached or refuses a command."""
        if not self._calls:
            return  # nothing to send (a run's end with nothing to leave or release)
        with translating():
            replies = await self._send()
            if any(isinstance(reply, NoScriptError) for reply in replies):
                for text in self._scripts.values():
                    await self._redis.script_load(text)
                replies = await self._send()
            for index, reply in enumerate(replies):
                if isinstance(reply, Exception) and index not in self._best_effort:
                    raise reply
        for (_args, then), reply in zip(self._calls, replies, strict=True):
            if then is not None:
                done = then(reply)
                if inspect.isawaitable(done):
                    await done

    async def _send(self) -> list[Any]:
        if self._best_effort and isinstance(self._redis, RedisCluster):
            return await self._send_apart()
        return await self._pipeline(range(len(self._calls)))

    async def _pipeline(self, indexes: Iterable[int]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for index in indexes:
                pipe.execute_command(*self._calls[index][0])
            return list(await pipe.execute(raise_on_error=False))

    async def _send_apart(self) -> list[Any]:
        """The batch on a cluster, its best-effort commands in a pipeline of their own
        sent once the others are answered: the cluster client fails a whole pipeline
        when one of its nodes cannot be reached, the commands it sent to the others run
        all the same. In one pipeline, a queued start whose wake-up's node was down
        failed (503, its storage figure taken back) though start.lua had created it, and
        it ran. Sent at the same time, the client's reset after the lost node closed
        the other pipeline's connection under it (the same 503, two runs in three)."""
        best = sorted(self._best_effort)
        rest = [index for index in range(len(self._calls)) if index not in self._best_effort]
        sent = await self._pipeline(rest)
        aside: list[Any]
        try:
            aside = await self._pipeline(best)
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            aside = [exc] * len(best)
        replies: list[Any] = [None] * len(self._calls)
        for index, reply in [*zip(rest, sent, strict=True), *zip(best, aside, strict=True)]:
            replies[index] = reply
        return replies


def is_unreachable(exc: BaseException) -> bool:
    """True for the errors ``translating`` turns into BufferUnavailable."""
    return isinstance(exc, (RedisError, RedisClusterException, OSError))
