"""The durable ceiling (ceiling.py) on a real value store: raised a block ahead in the
background as ids come near it, one write per block, each owner its own record, and
read back as the highest of them; the writer shows an unstored event only under it.
(Step 15: an owner lost across a restore from an older snapshot.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from lib.execution.ceiling import Ceiling, read_durable, record_name
from lib.execution.values import LocalValueStore
from tests.support.api import until
from tests.support.timing import hold_for


class CountingStore(LocalValueStore):
    """A local store that counts record writes and can hold them (a seam)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root)
        self.writes = 0
        self.open = asyncio.Event()
        self.open.set()

    async def put_record(self, execution_id: str, name: str, data: bytes) -> None:
        await self.open.wait()
        self.writes += 1
        await super().put_record(execution_id, name, data)


async def test_the_ceiling_is_raised_a_block_ahead_once_per_block(tmp_path: Path) -> None:
    values = CountingStore(tmp_path)
    raised: list[int] = []
    ceiling = Ceiling(
        values=values, execution_id="ex_c", fence="node:1", epoch=2, base=10, block=100
    )
    ceiling.on_raised = lambda: raised.append(ceiling.value)
    assert ceiling.value == 10  # reserved by the claim itself: no write needed for it
    ceiling.want(10)
    await hold_for(0.02, "a window in which an id the claim reserved may start no write")
    assert values.writes == 0
    ceiling.want(11)
    await until(lambda: raised == [111], "raised a block past the id wanted")
    for event_id in range(12, 61):  # all more than half a block below it
        ceiling.want(event_id)
    await hold_for(0.02, "a window in which no second write may start")
    assert values.writes == 1
    ceiling.want(62)  # within half a block: raised again
    await until(lambda: raised == [111, 162], "raised again")
    await ceiling.close()
    stored = orjson.loads((await values.records("ex_c"))[0])
    assert stored == {"ceiling": 162, "base": 10, "epoch": 2}


async def test_a_held_write_keeps_the_ceiling_where_it_was(tmp_path: Path) -> None:
    values = CountingStore(tmp_path)
    values.open.clear()
    ceiling = Ceiling(values=values, execution_id="ex_c", fence="node:1", epoch=1, base=1)
    ceiling.want(2)
    await hold_for(0.05, "a window in which the held write may not raise it")
    assert ceiling.value == 1
    values.open.set()
    await until(lambda: ceiling.value > 1, "raised once the write went")
    await ceiling.close()


async def test_the_highest_ceiling_and_base_of_every_owner_are_read_back(tmp_path: Path) -> None:
    values = LocalValueStore(root=tmp_path)
    for fence, record in [
        ("node:a", {"ceiling": 4097, "base": 1, "epoch": 1}),
        ("node:b", {"ceiling": 9000, "base": 4097, "epoch": 2}),
        ("node:c", {"ceiling": 300, "base": 0, "epoch": 3}),
    ]:
        await values.put_record("ex_d", record_name(fence), orjson.dumps(record))
    final = {"id": 120, "final": {"type": "execution:completed"}}
    await values.put_record("ex_d", record_name("node:a", "final"), orjson.dumps(final))
    await values.put_record("ex_d", "rec_" + "0" * 16, b"not json")
    durable = await read_durable(values, "ex_d")
    assert (durable.ceiling, durable.base, durable.final) == (9000, 4097, final)
    assert (await read_durable(values, "ex_none")).ceiling == 0
