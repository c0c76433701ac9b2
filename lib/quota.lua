--[[
quota.lua: one tenant's storage ledger: set what some of its things keep in Redis, all
or none, refusing growth past the tenant's limit (FLOWCAST_TENANT_STORAGE_BYTES).

KEYS[1]  the tenant's ledger        fc:{t:<tenant>}:quota        (sorted set: each thing,
         scored by when it stops counting, in ms on Redis's clock; +inf for workflows
         and secrets, which count until they are deleted)
KEYS[2]  the ledger's sizes         fc:{t:<tenant>}:quota:bytes  (hash: thing -> bytes,
         and "total" -> their sum, kept in the same step as every change)
ARGV[1]  the limit: refused when the things grow in all and the total would pass it
         (0: never refused; a running execution's figure is always kept)
ARGV[2 ..] per thing, three values (none: change nothing, only answer):
         - the thing: "e:<execution id>", "v:<workflow version digest>",
           "w:<workflow id>", "s:<secret name>"
         - its size in bytes from now on (its figure replaces the previous one: a lost
           or repeated call never adds up)
         - how long it counts from now, in ms (0: until set again or forgotten; -1:
           forget it now, whatever its size says)

Things past their time are forgotten first (at most 1000 per call; the rest by the next
calls), their sizes leaving the total: a figure left by a process killed between two
writes stops counting when the thing it counts expires, so the total cannot drift for
good.

Returns {1, total, previous...} when set (the total after it, then each thing's previous
size, in ARGV's order) or {0, total, needed, retry_ms} when refused: nothing is set,
needed is how many bytes the things would add, and retry_ms how long until the first
thing that expires stops counting (-1: none expires). No error reply.
]]

local ledger, sizes = KEYS[1], KEYS[2]
local limit = tonumber(ARGV[1])
local now = now_ms()

local total = tonumber(redis.call("HGET", sizes, "total")) or 0
local expired = redis.call("ZRANGEBYSCORE", ledger, "-inf", now, "LIMIT", 0, 1000)
for _, gone in ipairs(expired) do
  total = total - (tonumber(redis.call("HGET", sizes, gone)) or 0)
  redis.call("HDEL", sizes, gone)
  redis.call("ZREM", ledger, gone)
end
if #expired > 0 then
  redis.call("HSET", sizes, "total", total)
end

if #ARGV < 2 then
  return {1, total}
end

local previous, growth = {}, 0
for i = 2, #ARGV, 3 do
  local before = tonumber(redis.call("HGET", sizes, ARGV[i])) or 0
  previous[#previous + 1] = before
  if tonumber(ARGV[i + 2]) < 0 then
    growth = growth - before
  else
    growth = growth + tonumber(ARGV[i + 1]) - before
  end
end
if limit > 0 and growth > 0 and total + growth > limit then
  local first = redis.call("ZRANGEBYSCORE", ledger, "-inf", "+inf", "WITHSCORES", "LIMIT", 0, 1)
  local score = first[2] and tonumber(first[2])
  local retry = -1
  if score and score < math.huge then
    retry = score - now
  end
  return {0, total, growth, retry}
end

for i = 2, #ARGV, 3 do
  local member, size, lifetime = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if lifetime < 0 then
    redis.call("ZREM", ledger, member)
    redis.call("HDEL", sizes, member)
  else
    local until_ms = "+inf"
    if lifetime > 0 then
      until_ms = now + lifetime
    end
    redis.call("ZADD", ledger, until_ms, member)
    redis.call("HSET", sizes, member, size)
  end
end
total = total + growth
redis.call("HSET", sizes, "total", total)
return {1, total, unpack(previous)}
