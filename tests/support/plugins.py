"""A plugin module for tests: loaded by a server through FLOWCAST_PLUGINS."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from lib.errors import BlockError
from lib.workflows.blocks.base import BlockContext
from lib.workflows.plugins import block


@block("shout")
async def shout(ctx: BlockContext, args: Any) -> dict[str, Any]:
    """Streams the words of ``args.text`` in capitals, then returns them."""
    words = str(args["text"]).upper().split()
    for word in words:
        ctx.emit_chunk(word + " ")
    return {"words": len(words), "execution": ctx.execution_id}


@block("flaky")
async def flaky(ctx: BlockContext, args: Any) -> dict[str, Any]:
    """Streams ``args.words`` words naming its attempt; attempts before ``args.succeedOn``
    (default 2) fail, retryably, after streaming them all (their message shows the key)."""
    words = [f"try{ctx.attempt}-w{i}" for i in range(int(args.get("words", 3)))]
    for word in words:
        ctx.emit_chunk(word + " ")
    if ctx.attempt < int(args.get("succeedOn", 2)):
        raise BlockError("flaky", f"attempt {ctx.attempt} with key {ctx.idempotency_key} fails")
    return {"attempt": ctx.attempt, "idempotencyKey": ctx.idempotency_key}


@block("crash")
async def crash(ctx: BlockContext, args: Any) -> dict[str, Any]:
    """Waits ``args.ms`` (default 0), then SIGKILLs its own process: a test's stand-in
    for a run whose process the kernel OOM-kills every time it runs there."""
    await asyncio.sleep(float(args.get("ms", 0)) / 1000)
    os.kill(os.getpid(), signal.SIGKILL)
    return {}
