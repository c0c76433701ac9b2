"""Blame: which run a process's death is charged to, so that a run that keeps killing
its process is quarantined and the runs that died beside it are recovered, never failed
for it (SPEC §7, §8).

When a process dies owning several runs they are not equally guilty, and nothing in
the dead process can say which one killed it (an OOM kill leaves no last words). So:

- A run whose owners died twice is a *suspect* from then on (claim.lua counts its
  ``deaths``). Not once: a replica that dies of anything (a lost machine, a deploy's
  SIGKILL, a lone server restarted) leaves its runs with one death each, and they are
  all taken over at once, as ever; only a run that was there at two deaths is watched.
- A process runs at most one suspect at a time, beside any number of other runs: a
  takeover of a suspect by a process that runs one already is refused (``SUSPECT``)
  and left for a process without one, or for later. A suspect that ran a probation
  (a lease) without its process dying is no longer that process's suspect (a killer
  kills soon after it lands: its block runs again), and the suspects the process takes
  while it still runs there come as a *crowd*: no death of the process is charged to
  anyone while one of them runs. So a lone server killed twice (every run a suspect)
  takes them all over within about a probation, and never charges a plain run.
- Each process keeps a record in Redis of how many runs it holds and which one is its
  suspect (``NodeRecords``), written before it takes a suspect over and whenever either
  changes. The takers of a dead process's runs read it to judge each (``Verdict``):

    the dead process ran       the run was        charged  then
    -------------------------  -----------------  -------  ------------------------------
    it alone (or no record)    -                  a crash  recovered; worker_lost past
                                                           FLOWCAST_MAX_RECOVERIES, as ever
    it and others              its suspect        a crash  quarantined: ends failed
    it and others, a suspect   not the suspect    nothing  recovered (a suspect at 2 deaths)
    it and others, no suspect  -                  nothing  recovered (a suspect at 2 deaths)

So a run that kills every process it lands on is quarantined at its third death (the
second made it a suspect, the third found it its process's only suspect beside others),
and a run that only died beside it is never charged for it. A run alone on a dying process keeps
FLOWCAST_MAX_RECOVERIES's meaning: its process may have died of anything. A run that
kills its process only after a probation is never the suspect when it does: past
``DEATHS_PER_RECOVERY`` deaths per recovery allowed (charged or not) it ends
``worker_lost`` all the same (takeovers.py), so no run kills processes without end.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

from redis.asyncio import Redis

from lib.backend import Keys, translated

# Deaths of its owners that make a run a suspect (claim.lua's SUSPECT refusal agrees).
SUSPECT_DEATHS = 2
# A dead process's record outlives the takeovers of its runs (a lease or so) by far.
RECORD_SECONDS = 24 * 3600
# Deaths of its owners (charged or not) a run may go through per recovery allowed
# (FLOWCAST_MAX_RECOVERIES + 1), before it ends worker_lost whoever is to blame.
DEATHS_PER_RECOVERY = 2


class Verdict(StrEnum):
    """Who one death is charged to, for one of the dead process's runs (claim.lua's
    ARGV[8])."""

    ALONE = "alone"  # it ran alone there (or no record): a crash, as ever
    SUSPECT = "suspect"  # the process's one suspect, beside others: quarantined
    BESIDE = "beside"  # beside the process's suspect: not charged
    CROWD = "crowd"  # several ran, none suspected: not charged


@dataclass(frozen=True)
class NodeRecord:
    """What a process last said it runs: how many runs, and its suspect ("" for none)."""

    runs: int
    suspect: str

    def verdict(self, execution_id: str) -> Verdict:
        """Who the death of this process is charged to, for its run ``execution_id``."""
        if self.runs <= 1:
            return Verdict.ALONE
        if self.suspect == execution_id:
            return Verdict.SUSPECT
        return Verdict.BESIDE if self.suspect else Verdict.CROWD


class NodeRecords:
    """The processes' records, on the buffer's Redis (``Keys.node``)."""

    def __init__(self, *, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    @translated
    async def write(self, node: str, record: NodeRecord) -> None:
        key = self.keys.node(node)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, "runs", record.runs)
            pipe.hset(key, "suspect", record.suspect)
            pipe.expire(key, RECORD_SECONDS)
            await pipe.execute()

    @translated
    async def read(self, node: str) -> NodeRecord | None:
        """The record of ``node``; None when it left none (or it expired)."""
        runs, suspect = await self.redis.hmget(self.keys.node(node), ["runs", "suspect"])
        if runs is None:
            return None
        named = suspect.decode() if isinstance(suspect, bytes) else (suspect or "")
        return NodeRecord(int(runs), named)


class Suspicion:
    """This process's side: its one suspect, and its record kept in step with what it
    runs (``runs``: the runs here, by execution id)."""

    def __init__(
        self,
        *,
        records: NodeRecords,
        node_id: str,
        runs: Collection[str],
        refresh_seconds: float,
        probation_seconds: float,
    ) -> None:
        self.records = records
        self.node_id = node_id
        self._runs = runs
        self._refresh_seconds = refresh_seconds
        self._probation_seconds = probation_seconds
        self.suspect = ""
        # Suspects taken once the probation was over, while this process's suspect still
        # ran: a crowd, so no death here is charged to anyone while one of them runs.
        self._crowd: set[str] = set()
        self._claiming = False  # taken, its claim not settled yet (not in ``runs`` yet)
        self._since = 0.0  # when the suspect was taken (monotonic)
        self._written: NodeRecord | None = None
        self._written_at = 0.0

    def busy(self) -> bool:
        """Whether a suspect runs here (or is being claimed), still on probation.

        A suspect that ran here a probation long without this process dying is no
        longer this process's suspect (it still is one wherever it runs next): the
        process may take the next, so that the runs of a process that died of something
        else (a lost machine) are not taken over one at a time for as long as each runs.
        """
        if not self.suspect:
            return False
        if self._claiming:
            return True
        on_probation = time.monotonic() - self._since < self._probation_seconds
        return on_probation and self.suspect in self._runs

    def crowded(self) -> bool:
        """Whether suspects taken as a crowd still run here (no death is charged)."""
        self._crowd &= set(self._runs)
        return bool(self._crowd)

    async def join(self, execution_id: str) -> None:
        """Take suspect ``execution_id`` as one of a crowd: this process's suspect (past
        its probation, or ended) is one no more, and no death here is charged to anyone
        while a crowd runs. A lone server killed twice (every run a suspect) thus takes
        its runs over within about a probation, not one run per probation; the price is
        that a killer among a crowd is charged nothing for that death (the cap on deaths
        still ends it, and elsewhere it lands alone as some process's suspect)."""
        if self.suspect:
            self._crowd.add(self.suspect)
        self._crowd.add(execution_id)
        self.suspect, self._claiming = "", False
        await self.publish(force=True)

    async def take(self, execution_id: str) -> None:
        """Record ``execution_id`` as this process's suspect before claiming it, so
        that a death from the moment it runs here is charged to it."""
        self.suspect, self._claiming = execution_id, True
        self._since = time.monotonic()
        await self.publish(force=True)

    async def settle(self, execution_id: str, *, suspect: bool) -> None:
        """The claim of ``execution_id`` (taken) is settled: it runs here as the suspect,
        or it is none (no death on it, the claim was refused, or it only ends here)."""
        if self.suspect != execution_id:
            return
        self._claiming = False
        if not suspect:
            self.suspect = ""
            await self.publish(force=True)

    async def publish(self, *, force: bool = False) -> None:
        """Write the record when it changed (its suspect ended, runs came or went), or
        when its refresh is due."""
        if self.suspect and not self.busy():
            # Its run here ended (paused, finished, moved, fenced) or it passed probation:
            # then it goes on as one of a crowd, and so do the suspects taken after it.
            if self.suspect in self._runs:
                self._crowd.add(self.suspect)
            self.suspect = ""
        runs = len(self._runs) + (1 if self._claiming and self.suspect not in self._runs else 0)
        record = NodeRecord(runs, self.suspect)
        due = time.monotonic() - self._written_at >= self._refresh_seconds
        if not force and not due and record == self._written:
            return
        await self.records.write(self.node_id, record)
        self._written, self._written_at = record, time.monotonic()
