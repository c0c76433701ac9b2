"""The parts the runner and the takeovers share, built once for the process.

``Transitions`` is the ownership state machine with what its transitions keep in step;
``Parts`` adds the run states, the endings, the executions running here and the
launcher that runs them. The app builds one ``Parts`` (``app/runtime.py build_runner``)
and hands the same object to the runner and the takeovers, so neither names them one
parameter at a time and both are sure to share each one.
"""

from __future__ import annotations

from dataclasses import dataclass

from lib.execution.admission import Admission
from lib.execution.buffer import EventBuffer
from lib.execution.control import ControlStreams
from lib.execution.ownership import Ownership
from lib.execution.queue import Queue
from lib.execution.store import StoreIdentity
from lib.execution.watchlists import WatchLists
from lib.workflows.finals import Finals
from lib.workflows.launcher import Launcher
from lib.workflows.leases import LocalRuns
from lib.workflows.runstate import RunStates


@dataclass(frozen=True)
class Transitions:
    """The ownership state machine and what its transitions keep in step: the watch
    lists, the tenant counts, the control streams and the store's identity."""

    ownership: Ownership
    watch: WatchLists
    admission: Admission
    control: ControlStreams
    store: StoreIdentity
    queue: Queue

    @classmethod
    def build(
        cls,
        buffer: EventBuffer,
        *,
        lease_seconds: float,
        limit: int = 0,
        running: int = 0,
        weights: dict[str, float] | None = None,
    ) -> Transitions:
        """Each part once, on ``buffer``; ``limit`` caps a tenant's unfinished executions,
        ``running`` those it runs at once (0: none), ``weights`` its share in the queue."""
        watch = WatchLists(buffer=buffer, lease_seconds=lease_seconds)
        admission = Admission(buffer=buffer, lease_seconds=lease_seconds, limit=limit)
        control = ControlStreams(buffer=buffer)
        queue = Queue(
            buffer=buffer,
            lease_seconds=lease_seconds,
            max_unfinished=limit,
            max_running=running,
            weights=weights,
        )
        ownership = Ownership(
            buffer=buffer,
            lease_seconds=lease_seconds,
            watch=watch,
            admission=admission,
            control=control,
            queue=queue,
        )
        store = StoreIdentity(buffer=buffer, lease_seconds=lease_seconds)
        return cls(ownership, watch, admission, control, store, queue)


@dataclass(frozen=True)
class Parts:
    """What the runner and the takeovers both act through."""

    buffer: EventBuffer
    transitions: Transitions
    states: RunStates
    finals: Finals
    runs: LocalRuns  # the executions running here, by id
    launcher: Launcher
    node_id: str

    def new_fence(self) -> str:
        """A fence of this process, for a transition it is about to ask for."""
        return self.transitions.ownership.new_fence(self.node_id)
