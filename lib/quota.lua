--[[
quota.lua: one tenant's storage ledger: set what one of its things keeps in Redis,
refusing growth past the tenant's limit (FLOWCAST_TENANT_STORAGE_BYTES).

KEYS[1]  the tenant's ledger        fc:{t:<tenant>}:quota        (sorted set: each thing,
         scored by when it stops counting, in ms on Redis's clock; +inf for workflows
         and secrets, which count until they are deleted)
KEYS[2]  the ledger's sizes         fc:{t:<tenant>}:quota:bytes  (hash: thing -> bytes,
         and "total" -> their sum, kept in the same step as every change)
ARGV[1]  the thing: "e:<execution id>", "w:<workflow id>", "s:<secret name>"
         ("": change nothing, only answer)
ARGV[2]  its size in bytes from now on (its figure replaces the previous one: a lost or
         repeated call never adds up)
ARGV[3]  how long it counts from now, in ms (0: until set again or forgotten; -1: forget
         it now, whatever ARGV[2] says)
ARGV[4]  the limit: refused when the thing grows and the total would pass it (0: never
         refused; a running execution's figure is always kept)

Things past their time are forgotten first (at most 1000 per call; the rest by the next
calls), their sizes leaving the total: a figure left by a process killed between two
writes stops counting when the thing it counts expires, so the total cannot drift for good.

Returns {1, total, previous} when set (total after it, the thing's previous size) or
{0, total, previous, retry_ms} when refused: nothing is set, and retry_ms is how long
until the first thing that expires stops counting (-1: none expires). No error reply.
]]

local ledger, sizes = KEYS[1], KEYS[2]
local member, size = ARGV[1], tonumber(ARGV[2])
local lifetime, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
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
if member == "" then
  return {1, total, 0}
end

local previous = tonumber(redis.call("HGET", sizes, member)) or 0
if lifetime < 0 then
  if redis.call("ZREM", ledger, member) == 1 then
    redis.call("HDEL", sizes, member)
    total = total - previous
    redis.call("HSET", sizes, "total", total)
  end
  return {1, total, previous}
end
local after = total - previous + size
if limit > 0 and size > previous and after > limit then
  local first = redis.call("ZRANGEBYSCORE", ledger, "-inf", "+inf", "WITHSCORES", "LIMIT", 0, 1)
  local score = first[2] and tonumber(first[2])
  local retry = -1
  if score and score < math.huge then
    retry = score - now
  end
  return {0, total, previous, retry}
end
local until_ms = "+inf"
if lifetime > 0 then
  until_ms = now + lifetime
end
redis.call("ZADD", ledger, until_ms, member)
redis.call("HSET", sizes, member, size, "total", after)
return {1, after, previous}
