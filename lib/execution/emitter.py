"""The emitter: gives each event its id and hands it to live readers and the writer."""

from __future__ import annotations

from typing import Any

from lib.execution.events import Event
from lib.execution.hub import LocalPublisher
from lib.execution.writer import EventWriter


class Emitter:
    """Assigns ids 1, 2, 3, … in emit order; publishing is synchronous and never waits."""

    def __init__(
        self,
        *,
        execution_id: str,
        workflow_id: str,
        publisher: LocalPublisher,
        writer: EventWriter,
        last_id: int = 0,
    ) -> None:
        self.execution_id = execution_id
        self.workflow_id = workflow_id
        self._publisher = publisher
        self._writer = writer
        self.last_id = last_id

    def emit(self, type: str, data: dict[str, Any]) -> Event:
        """Emit one event now: readers attached here see it before it is stored."""
        self.last_id += 1
        event = Event(
            id=self.last_id,
            type=type,
            execution_id=self.execution_id,
            workflow_id=self.workflow_id,
            data=data,
        )
        self._publisher.publish(event)
        self._writer.put(event)
        return event
