"""The ownership state machine with the parts it keeps in step, on one buffer, built
as the app builds them (``build_runner`` in app/services.py)."""

from __future__ import annotations

from dataclasses import dataclass

from lib.execution.admission import Admission
from lib.execution.buffer import EventBuffer
from lib.execution.control import ControlStreams
from lib.execution.ownership import Ownership
from lib.execution.store import StoreIdentity
from lib.execution.watchlists import WatchLists


@dataclass(frozen=True)
class Parts:
    ownership: Ownership
    watch: WatchLists
    admission: Admission
    control: ControlStreams
    store: StoreIdentity


def ownership_parts(buffer: EventBuffer, lease_seconds: float) -> Parts:
    watch = WatchLists(buffer=buffer, lease_seconds=lease_seconds)
    admission = Admission(buffer=buffer, lease_seconds=lease_seconds)
    control = ControlStreams(buffer=buffer)
    ownership = Ownership(
        buffer=buffer,
        lease_seconds=lease_seconds,
        watch=watch,
        admission=admission,
        control=control,
    )
    store = StoreIdentity(buffer=buffer, lease_seconds=lease_seconds)
    return Parts(ownership, watch, admission, control, store)
