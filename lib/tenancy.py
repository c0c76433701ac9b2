"""The tenant whose work the current task does.

Set by a request's authentication (``app/services.py``) and by a run (the launcher), and
read where a shared resource is split by tenant: log lines are masked with that tenant's
secrets only, and provider permits are shared fairly between the tenants that wait
(``FairGate``, also the one workflow checker's line).
A task started from another inherits it (contextvars).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator
from contextvars import ContextVar

CURRENT_TENANT: ContextVar[str | None] = ContextVar("flowcast_tenant", default=None)


class FairGate:
    """At most ``cap`` tasks inside at once; the others wait, taken by fair queuing
    (as slots.lua takes provider slots across processes): a call's place is one past
    the later of its tenant's last place and the place of the latest call let in, so
    each tenant's calls go in arrival order and the tenants in turn. A call cancelled
    while it waits gives its place back as slots.lua's do."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.inside = 0
        self._clock = 0  # the place of the latest call let in
        self._last: dict[str, int] = {}  # each waiting tenant's last place
        self._waiting: dict[str, int] = {}  # how many calls of each tenant wait
        self._line: list[tuple[int, int, asyncio.Future[None], str]] = []  # a heap
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def entered(self, tenant: str) -> AsyncIterator[None]:
        place = max(self._clock, self._last.get(tenant, 0)) + 1
        self._last[tenant] = place
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1
        if self.inside < self.cap and not self._line:
            self._let_in(tenant, place)
        else:
            turn = asyncio.get_running_loop().create_future()
            heapq.heappush(self._line, (place, next(self._arrivals), turn, tenant))
            try:
                await turn  # let in by _leave, counted inside already
            except BaseException:
                if turn.done() and not turn.cancelled():
                    self._leave()  # let in as it was cancelled: the place goes on
                else:  # its entry in the line is skipped when it comes up
                    self._gave_up(tenant, place)
                raise
        try:
            yield
        finally:
            self._leave()

    def __len__(self) -> int:
        """How many calls wait in this line (a cancelled one until it comes up)."""
        return len(self._line)

    def _let_in(self, tenant: str, place: int) -> None:
        self.inside += 1
        self._clock = max(self._clock, place)
        self._left_line(tenant, place)  # nothing of its own waits behind: forgotten

    def _gave_up(self, tenant: str, place: int) -> None:
        """A call cancelled while it waited: its tenant's next call does not stand
        behind it (the step 16 fresh-eyes review: five cancelled calls put A's next
        one behind every call B queued meanwhile)."""
        self._left_line(tenant, place)

    def _left_line(self, tenant: str, place: int) -> None:
        """A call of ``tenant`` no longer waits: a tenant with none left waiting is
        forgotten; one whose last call left steps back to ``place - 1``, which is as
        good as its call before (a place is one past the later of that and the clock,
        and the clock only grows)."""
        left = self._waiting[tenant] - 1
        if left == 0:
            del self._waiting[tenant], self._last[tenant]
            return
        self._waiting[tenant] = left
        if self._last[tenant] == place:
            self._last[tenant] = place - 1

    def _leave(self) -> None:
        self.inside -= 1
        while self.inside < self.cap and self._line:
            place, _arrival, turn, tenant = heapq.heappop(self._line)
            if not turn.done():
                self._let_in(tenant, place)
                turn.set_result(None)
