--[[
slots.lua: one provider's concurrency slots, shared by every process (a lease-based
semaphore on Redis's clock), taken in turn by the tenants that wait: each tenant's calls
in arrival order, the tenants by fair queuing (a call's place is one past the later of
its tenant's last place and the place of the latest grant), so a tenant with one call
waiting is served next to one with a hundred (step 16's review: cap 2, ten queued calls
of tenant A, B's one call waited ~20 s). A tenant alone may use every slot.

KEYS[1]  holders: zset token -> lease end (ms)        fc:{llm:<provider>}:holders
KEYS[2]  queue:   zset token -> ticket (arrival order) fc:{llm:<provider>}:queue
KEYS[3]  waiters: zset token -> alive until (ms)       fc:{llm:<provider>}:waiters
KEYS[4]  fair:    hash tenant -> its last place,       fc:{llm:<provider>}:fair
                  "@clock" -> the place of the latest grant,
                  "n:" .. tenant -> how many of its calls wait,
                  "#" .. token -> the tenant of a waiting call
KEYS[5]  freed:   a stream, one entry per freed slot   fc:{llm:<provider>}:freed
KEYS[6]  pause:   set while the provider asked to wait fc:{llm:<provider>}:pause
KEYS[7]  store:   hash runId, grantsFrom               fc:{llm:<provider>}:store
ARGV[1]  operation: "acquire", "renew", "release", "pause" or "hello"
ARGV[2]  the caller's token
ARGV[3]  acquire: the cap; pause: how long to pause (ms)
ARGV[4]  lease length in milliseconds
ARGV[5]  acquire, renew, hello: the server the caller last saw answer (a run id; ""
         if none)
ARGV[6]  acquire: the caller's tenant ("" for none)

Returns
  acquire  {1, 0, "", 0, server} when the caller now holds a slot, else
           {0, wait, freed, paused, server}: try again within `wait` ms (a holder's
           lease ends, the pause or the settling ends, or the caller must show it is
           still waiting), or as soon as the freed stream has an entry after id
           `freed` ("0-0" when it is empty); `paused` is the provider's pause left in
           ms (0 when none); `server` is the run id of the server answering
  renew    {1, server} when the holder's lease is extended; {0, server} when the
           holder is gone (its lease ended, e.g. while its process stalled, and the
           slot went on; or the store forgot it): it is never counted again, its
           call must stop
  release  1 when a slot was freed, else 0
  pause    the pause left, in ms (the longer of the one asked and the one set)
  hello    the server: a process learns it at start, so that it knows the server
           changed even if its first call comes after the change

Holders whose lease ended (a crashed process) and waiters that stopped asking are
dropped on every acquire, so a dead process never keeps a slot or a place in line.
Every key expires a while after the provider was last used.

When the keys answer from another server than before (a restart, empty or from an
older copy, or a replica promoted), told by the caller (ARGV[5]) or by the keys
(KEYS[7]), holders may be calling whom the store forgot: no slot is granted until one
lease later, when each of them has renewed, found itself gone and stopped. (The same
idea as ownership's store.lua; a FLUSHALL on the same server is not noticed.)
]]

local holders, queue, waiters, fair, freed, pause = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local store = KEYS[7]
local op, token = ARGV[1], ARGV[2]
local lease = tonumber(ARGV[4])
local now = now_ms()
local keep = lease * 4 + 60000

local function touch()
  for _, key in ipairs({holders, queue, waiters, fair, freed, store}) do
    redis.call("PEXPIRE", key, keep)
  end
end

-- The server answering now, and from when slots may be granted (ms, Redis's clock).
local function server()
  local id = string.match(redis.call("INFO", "server"), "run_id:(%w+)")
  local known = redis.call("HMGET", store, "runId", "grantsFrom")
  local from = tonumber(known[2]) or 0
  local seen = ARGV[5] or ""
  if (known[1] and known[1] ~= id) or (seen ~= "" and seen ~= id) then
    from = math.max(from, now + lease)
    redis.call("HSET", store, "runId", id, "grantsFrom", from)
    redis.call("PEXPIRE", store, keep)
  elseif not known[1] then
    redis.call("HSET", store, "runId", id, "grantsFrom", 0)
    redis.call("PEXPIRE", store, keep)
  end
  return id, from
end

local function last_freed()
  local last = redis.call("XREVRANGE", freed, "+", "-", "COUNT", 1)
  if #last == 0 then
    return "0-0"
  end
  return last[1][1]
end

-- A waiting call leaves the line (granted, released or dropped): a tenant with no call
-- left waiting is forgotten, and one whose last call left steps back, so calls
-- cancelled in line do not put the tenant's next call behind others (the step 16
-- fresh-eyes review). Stepping back to place - 1 is as good as to the place of its
-- call before: a new call's place is one past the later of that and the clock, and
-- place - 1 was the later of the two when the call came, and the clock only grows.
local function leave_line(gone, place)
  local who = redis.call("HGET", fair, "#" .. gone)
  if not who then
    return false  -- queued before the tenants of calls were kept
  end
  redis.call("HDEL", fair, "#" .. gone)
  if redis.call("HINCRBY", fair, "n:" .. who, -1) <= 0 then
    redis.call("HDEL", fair, who, "n:" .. who)
  elseif tonumber(redis.call("HGET", fair, who)) == place then
    redis.call("HSET", fair, who, place - 1)
  end
  return true
end

local function announce()
  redis.call("XADD", freed, "MAXLEN", "~", 64, "*", "t", token)
end

if op == "hello" then
  return (server())
end

if op == "renew" then
  local id = server()
  if not redis.call("ZSCORE", holders, token) then
    return {0, id}
  end
  redis.call("ZADD", holders, now + lease, token)
  touch()
  return {1, id}
end

if op == "release" then
  local freed_slot = redis.call("ZREM", holders, token)
  local place = tonumber(redis.call("ZSCORE", queue, token))
  if place then
    redis.call("ZREM", queue, token)
    leave_line(token, place)
  end
  redis.call("ZREM", waiters, token)
  if freed_slot == 1 then
    announce()
  end
  touch()
  return freed_slot
end

if op == "pause" then
  local ask = tonumber(ARGV[3])
  local left = redis.call("PTTL", pause)
  if left < ask then
    redis.call("SET", pause, "1", "PX", ask)
    left = ask
  end
  return left
end

-- acquire
local id, grants_from = server()
local cap = tonumber(ARGV[3])
local expired = redis.call("ZRANGEBYSCORE", holders, "-inf", now)
if #expired > 0 then
  redis.call("ZREMRANGEBYSCORE", holders, "-inf", now)
  announce()
end
for _, gone in ipairs(redis.call("ZRANGEBYSCORE", waiters, "-inf", now)) do
  local place = tonumber(redis.call("ZSCORE", queue, gone))
  if place then
    redis.call("ZREM", queue, gone)
    leave_line(gone, place)
  end
  redis.call("ZREM", waiters, gone)
end
if redis.call("ZSCORE", holders, token) then
  -- The caller holds a slot already (its earlier acquire's reply was lost).
  redis.call("ZADD", holders, now + lease, token)
  touch()
  return {1, 0, "", 0, id}
end
local tenant = ARGV[6] or ""
if not redis.call("ZSCORE", queue, token) then
  local clock = tonumber(redis.call("HGET", fair, "@clock")) or 0
  local place = math.max(clock, tonumber(redis.call("HGET", fair, tenant)) or 0) + 1
  redis.call("HSET", fair, tenant, place, "#" .. token, tenant)
  redis.call("HINCRBY", fair, "n:" .. tenant, 1)
  redis.call("ZADD", queue, place, token)
end
redis.call("ZADD", waiters, now + lease, token)
touch()
-- Ask again before the waiter entry ends, so a live waiter keeps its place.
local wait = math.max(math.floor(lease / 3), 1)
local paused = redis.call("PTTL", pause)
if paused > 0 then
  return {0, math.min(wait, paused), last_freed(), paused, id}
end
if grants_from > now then
  return {0, math.min(wait, grants_from - now), last_freed(), 0, id}
end
local free = cap - redis.call("ZCARD", holders)
if free > 0 and redis.call("ZRANK", queue, token) < free then
  local place = tonumber(redis.call("ZSCORE", queue, token))
  if place > (tonumber(redis.call("HGET", fair, "@clock")) or 0) then
    redis.call("HSET", fair, "@clock", place)
  end
  redis.call("ZREM", queue, token)
  if not leave_line(token, place) and (tonumber(redis.call("HGET", fair, tenant)) or 0) <= place then
    redis.call("HDEL", fair, tenant)  -- nothing of its own waits behind: forgotten
  end
  redis.call("ZREM", waiters, token)
  redis.call("ZADD", holders, now + lease, token)
  touch()  -- holders may be new: one that dies before renewing must not keep it for ever
  return {1, 0, "", 0, id}
end
local first = redis.call("ZRANGE", holders, 0, 0, "WITHSCORES")
if #first > 0 then
  wait = math.max(math.min(wait, tonumber(first[2]) - now + 1), 1)
end
return {0, wait, last_freed(), 0, id}
