"""What the queue's keys hold once a storm is over (SPEC §14 "queue memory is
proportional to the backlog"), read straight from Valkey for the queue storm."""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from lib.backend import Keys


@dataclass
class Leftovers:
    """What the queue's keys held once every execution had ended."""

    lines: dict[str, int] = field(default_factory=dict)  # queued:<tenant> -> members
    waiting: int = 0
    taken: int = 0
    running: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    now_ms: float = 0.0
    # stream -> (length, consumers, pending entries, seconds to live or -1)
    streams: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    other: list[str] = field(default_factory=list)


async def queue_keys(redis: Redis | None, keys: Keys) -> Leftovers:
    """Read every key of the queue and the control streams."""
    found = Leftovers()
    if redis is None:
        return found
    seconds, micros = await redis.time()
    found.now_ms = seconds * 1000 + micros / 1000
    async for raw in redis.scan_iter(match=f"{keys.prefix}:{{*", count=1000):
        key = raw.decode()
        if key.startswith(f"{keys.prefix}:{{ex_"):
            continue  # an execution's own keys
        kind = (await redis.type(key)).decode()
        if key.startswith(f"{keys.prefix}:{{queue}}:queued:"):
            found.lines[key] = int(await redis.zcard(key))
        elif key == keys.waiting:
            found.waiting = int(await redis.zcard(key))
        elif key == keys.taken:
            found.taken = int(await redis.zcard(key))
        elif key.startswith(f"{keys.prefix}:{{queue}}:running:"):
            members = await redis.zrange(key, 0, -1, withscores=True)
            found.running[key] = [(m.decode(), float(s)) for m, s in members]
        elif kind == "stream":
            groups = await redis.xinfo_groups(key)
            consumers = sum(int(g["consumers"]) for g in groups)
            pending = sum(int(g["pending"]) for g in groups)
            length, ttl = int(await redis.xlen(key)), int(await redis.ttl(key))
            found.streams[key] = (length, consumers, pending, ttl)
        elif key != keys.fair and ":{t:" not in key:
            found.other.append(f"{key} ({kind})")
    return found
