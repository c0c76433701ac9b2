--[[
outbox.lua: the webhook deliveries owed, and who attempts which (SPEC §15). Every key
is under the hash tag {webhooks}, so each operation is one atomic step, also on a
cluster.

Keys (passed in KEYS, as each operation lists them):
  owed     fc:{webhooks}:owed          sorted set: "<eid> <eventId>" for each final event
           (paused or terminal) of an execution with webhooks, written *before* the
           batch that stores it; scored by when to look at it (ms, Redis's clock)
  tenants  fc:{webhooks}:tenants       sorted set: each tenant with deliveries, scored
           by its earliest due one, or when it was last served if that is later (so
           tenants take turns: one served goes behind those waiting since before, however
           old its backlog)
  served   fc:{webhooks}:served        hash: tenant -> when one of its deliveries was last
           taken (ms), for the tenants in `tenants`
  due      fc:{webhooks}:due:<tenant>  sorted set: "<eid> <eventId> <n>" (n: which of
           the execution's webhooks), scored by when it is due; an attempt in flight is
           leased by pushing its score past the attempt's timeout
  pending  fc:{webhooks}:pending       sorted set: the same members, scored by when
           they were owed (the age of the oldest, for /metrics)

ARGV[1] is the operation:

"hint"   KEYS owed; ARGV[2] delay ms, ARGV[3 ..] the hints ("<eid> <eventId>")
         Adds each hint (NX: one already there keeps its time), due after the delay.
"next"   KEYS owed, tenants
         The milliseconds until the earliest hint or tenant is due (0: now), -1: none
         (a delivery process waits that long, or for a wake, instead of polling).
"look"   KEYS owed; ARGV[2] lease ms, ARGV[3] most to return
         The hints due now, each pushed ARGV[2] ms ahead (a looker that dies leaves
         them to the next one). Returns the members.
"owe"    KEYS owed, tenants, due, pending, served; ARGV[2] the hint ("" for none), ARGV[3 ..]
         the deliveries to owe: member, member, …
         Adds each delivery due now (NX: owed once, however many look), drops the hint.
"take"   KEYS tenants, due, served; ARGV[2] lease ms
         Leases the tenant's earliest delivery due now. Returns it, or false.
"settle" KEYS tenants, due, pending, served; ARGV[2] member, ARGV[3] "" when it is over (else
         the delay in ms before its next attempt)
         Reschedules only a delivery still owed (XX): an attempt settled after a
         restore that lost its delivery must not bring it back a retry later, ahead of
         the "owe" that owes it again now (its NX would keep the later time).
"swap"   KEYS secrets (fc:{webhooks}:secrets, signing.py); ARGV[2] tenant, ARGV[3] the
         sealed record read ("" when none), ARGV[4] the new one
         Stores the new record only if the tenant's is still the one read (a rotation
         racing another must not drop the secret the other answered). Returns 1 if
         stored, else 0.
Returns nil unless said otherwise (also for an operation it does not know).

"hint", "owe" and a "settle" that schedules another attempt publish "" on the wake
channel fc:{webhooks}:wake (pub/sub, beside the keys): something may now be due sooner
than the delivery processes were told by "next", and they ask again.
]]

local op = ARGV[1]
local now = now_ms()

-- The tenant's score in `tenants`: its earliest due delivery or when it was last
-- served, whichever is later; gone with its last delivery.
local function rescore(tenants, due, served, tenant)
  local head = redis.call("ZRANGE", due, 0, 0, "WITHSCORES")
  if head[1] then
    local score = tonumber(head[2])
    local last = tonumber(redis.call("HGET", served, tenant) or "0")
    redis.call("ZADD", tenants, math.max(score, last), tenant)
  else
    redis.call("ZREM", tenants, tenant)
    redis.call("HDEL", served, tenant)
  end
end

-- Tell the delivery processes to ask "next" again (the channel beside `key`).
local function wake(key)
  redis.call("PUBLISH", string.match(key, "^(.*:)[^:]*$") .. "wake", "")
end

local function tenant_of(due)
  return string.match(due, ":due:(.*)$")
end

if op == "hint" then
  for i = 3, #ARGV do
    redis.call("ZADD", KEYS[1], "NX", now + tonumber(ARGV[2]), ARGV[i])
  end
  wake(KEYS[1])
  return nil
elseif op == "next" then
  local soonest = nil
  for i = 1, 2 do
    local head = redis.call("ZRANGE", KEYS[i], 0, 0, "WITHSCORES")
    if head[1] and (not soonest or tonumber(head[2]) < soonest) then
      soonest = tonumber(head[2])
    end
  end
  if not soonest then
    return -1
  end
  return math.max(0, soonest - now)
elseif op == "look" then
  local found = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", now, "LIMIT", 0, tonumber(ARGV[3]))
  for _, member in ipairs(found) do
    redis.call("ZADD", KEYS[1], now + tonumber(ARGV[2]), member)
  end
  return found
elseif op == "owe" then
  local owed, tenants, due, pending, served = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
  for i = 3, #ARGV do
    redis.call("ZADD", due, "NX", now, ARGV[i])
    redis.call("ZADD", pending, "NX", now, ARGV[i])
  end
  if #ARGV >= 3 then
    rescore(tenants, due, served, tenant_of(due))
    wake(tenants)
  end
  if ARGV[2] ~= "" then
    redis.call("ZREM", owed, ARGV[2])
  end
  return nil
elseif op == "take" then
  local tenants, due, served = KEYS[1], KEYS[2], KEYS[3]
  local head = redis.call("ZRANGEBYSCORE", due, "-inf", now, "LIMIT", 0, 1)
  if not head[1] then
    rescore(tenants, due, served, tenant_of(due))
    return false
  end
  redis.call("ZADD", due, now + tonumber(ARGV[2]), head[1])
  redis.call("HSET", served, tenant_of(due), now)
  rescore(tenants, due, served, tenant_of(due))
  return head[1]
elseif op == "swap" then
  local found = redis.call("HGET", KEYS[1], ARGV[2])
  if (found or "") ~= ARGV[3] then
    return 0
  end
  redis.call("HSET", KEYS[1], ARGV[2], ARGV[4])
  return 1
elseif op == "settle" then
  local tenants, due, pending, served = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  if ARGV[3] == "" then
    redis.call("ZREM", due, ARGV[2])
    redis.call("ZREM", pending, ARGV[2])
  else
    redis.call("ZADD", due, "XX", now + tonumber(ARGV[3]), ARGV[2])
  end
  rescore(tenants, due, served, tenant_of(due))
  if ARGV[3] ~= "" then
    wake(tenants)
  end
  return nil
end
return nil
