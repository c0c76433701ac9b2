"""``python -m bench.hookless <uvicorn arguments>``: Flowcast under uvicorn with its
tracing hooks taken out (``lib/tracing.py``'s calls replaced by bare no-ops before the
app is built): the ``without`` server of the traces rows (bench/traces.py), the build
as it was before traces, to set the ``off`` server beside."""

from __future__ import annotations

import contextlib
from typing import Any

from uvicorn.main import main

from lib import tracing


def _none(*_args: Any, **_kwargs: Any) -> None:
    return None


_NO_CONTEXT = contextlib.nullcontext()
_NO_BLOCK_SPAN = contextlib.nullcontext(tracing.BlockSpan())

if __name__ == "__main__":
    tracing.start = _none
    tracing.new_trace = _none
    tracing.end_execution = _none
    tracing.execution_context = lambda _trace: _NO_CONTEXT
    tracing.block_span = lambda *_args: _NO_BLOCK_SPAN
    main()
