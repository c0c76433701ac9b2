"""What one run holds in this process's memory, against a bound per execution (SPEC §8
"Shares per tenant"): a replica's memory is bounded by what it runs.

A run holds its input and its blocks' outputs as kept (large ones are refs into the
value store, and what stays inline counts against the byte budget too: checkpoint.py),
and, while a block's attempt runs, the stored values its templates load back. Each is
sized without walking it: the input's JSON once (orjson, in C), each kept output's JSON
(the checkpoint's, already encoded), each ref by the ``size`` it carries, before its
value is read. Past the bound the block fails with ``execution_memory`` before the value
is read, so one run can no longer take its process down (and every run beside it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from lib.errors import BlockError

MEMORY_CODE = "execution_memory"


def _mib(size: int) -> str:
    return f"{size / 1048576:.1f} MiB"


class Holdings:
    """One run's bytes held (input and kept outputs) and loaded (values its running
    attempts loaded back), against ``limit`` (0: no bound)."""

    def __init__(self, *, limit: int, held: int = 0) -> None:
        self.limit = limit
        self.held = held
        self.loaded = 0

    def keep(self, block_id: str, size: int) -> None:
        """Hold a block's kept output of ``size`` bytes, or fail the block past the bound."""
        if self.limit and self.held + self.loaded + size > self.limit:
            raise BlockError(
                MEMORY_CODE,
                f"the output of {block_id!r} ({_mib(size)} as kept) would take the "
                f"execution to {_mib(self.held + self.loaded + size)} held in memory; one "
                f"execution may hold at most {_mib(self.limit)} "
                "(FLOWCAST_EXECUTION_MEMORY_BYTES)",
                retryable=False,
            )
        self.held += size

    def load(self, block_id: str, size: int) -> None:
        """Count a stored value of ``size`` bytes a template of ``block_id`` loads back,
        before it is read; fail the block past the bound (``release`` gives it back)."""
        if self.limit and self.held + self.loaded + size > self.limit:
            raise BlockError(
                MEMORY_CODE,
                f"the templates of {block_id!r} read a stored value of {_mib(size)}, which "
                f"would take the execution to {_mib(self.held + self.loaded + size)} held "
                f"in memory; one execution may hold at most {_mib(self.limit)} "
                "(FLOWCAST_EXECUTION_MEMORY_BYTES)",
                retryable=False,
            )
        self.loaded += size

    @contextlib.contextmanager
    def loading(self, block_id: str) -> Iterator[Callable[[int], None]]:
        """Within it, ``count(size)`` counts a value loaded back for ``block_id``'s
        templates (or conditions); all are given back when it ends."""
        loaded = 0

        def count(size: int) -> None:
            nonlocal loaded
            self.load(block_id, size)
            loaded += size

        try:
            yield count
        finally:
            self.loaded -= loaded
