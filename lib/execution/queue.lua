--[[
queue.lua: the admission of every tenant's work and the fair queue of what waits (SPEC
§14). Every key is under the hash tag {queue}, so each operation is one atomic step,
also on a cluster.

Keys (all passed in KEYS, as each operation lists them):
  running  fc:{queue}:running:<tenant>  sorted set: the fencing token of each running
           ownership, scored by lease end, and "paused:<eid>" for each paused execution,
           scored by when its keys would expire (admission.py, watch.lua)
  queued   fc:{queue}:queued:<tenant>   sorted set: the tenant's queued execution ids,
           scored by when they were queued (a continuation scores below every start)
  waiting  fc:{queue}:tenants           sorted set: each tenant with queued work, scored
           by its virtual time (the service it had, divided by its weight)
  fair     fc:{queue}:fair              hash: "clock" (the virtual time of the last
           tenant served), "w:<tenant>" (a weight, FLOWCAST_TENANT_WEIGHTS), and per
           tenant its drain rate: "dw:<tenant>" when the current minute began, "dn:" its
           admissions in it, "dp:" those of the minute before
  taken    fc:{queue}:taken             sorted set: "<eid> <fence> <score> <tenant>" (its
           score in its line) for each
           execution taken from the queue and not yet claimed (claim.lua "take"),
           scored by when the taker is presumed dead

ARGV[1] is the operation:

"enter"  KEYS running, queued, waiting, fair
         ARGV[2] the execution id, ARGV[3] the fencing token of the run to admit,
         ARGV[4] lease ms, ARGV[5] how long (ms) an entry of a dead owner goes on
         counting, ARGV[6] most unfinished executions of the tenant (0 = no limit),
         ARGV[7] most running (0 = no limit), ARGV[8] "1" when the caller has a free
         worker slot, ARGV[9] the tenant
         Returns {1} when it runs at once (the token is admitted: the caller creates it
         running), {2, ahead} when it is queued, {0, retry} when the tenant has its
         limit of unfinished executions (nothing is written): `retry` is when to try
         again, in seconds, from its recent drain rate (its admissions over the last
         one to two minutes: at its limit, one starts as one ends). It runs at once only when nothing
         waits anywhere (a queued execution of any tenant goes first, fairly, through
         "take") and the tenant runs fewer than its limit.
"take"   KEYS waiting, fair, taken, then running and queued of each candidate tenant
         ARGV[2] the taker's new fencing token, ARGV[3] lease ms, ARGV[4] the grace
         (ARGV[5] of "enter"), ARGV[5] most running per tenant, ARGV[6] the default
         weight, ARGV[7 ..] the candidate tenants (the first of `waiting`, in order)
         Of the candidates still waiting and running fewer than their limit, serves the
         one with the least virtual time: pops its oldest queued execution, admits the
         token in its running set and records the delivery in `taken`. Returns {eid,
         tenant, queued score, taken member} or {} when no candidate can run one.
"room"   KEYS running; ARGV[2] the fencing token of a continuation to admit (a resume),
         ARGV[3] lease ms, ARGV[4] the grace of "enter", ARGV[5] most running
         Returns 1 when the tenant runs fewer than its limit (the token is admitted),
         0 otherwise (nothing is written): the continuation then waits in line ("line").
"line"   KEYS running, queued, waiting, fair; ARGV[2] eid, ARGV[3] the tenant, ARGV[4]
         the member it replaces in `running` ("paused:<eid>": it counts as queued now)
         Queues a continuation ahead of every start of its tenant (once: a second
         "line" of the same id keeps its place); returns its `ahead`.
"again"  KEYS queued, waiting, fair; ARGV[2] eid, ARGV[3] the tenant, ARGV[4] its score:
         a queued execution no line holds (the store lost the line: the reconciler) is
         put back in line; returns 1, or 0 when it was in line already
"claimed" KEYS taken; ARGV[2] the taken member: the delivery is over (claimed, or its
         claim refused: a stale delivery)
"stale"  KEYS taken; ARGV[2] the most to return: the members whose taker is presumed
         dead (past their score), oldest first
"requeue" KEYS running, queued, waiting, fair, taken; ARGV[2] eid, ARGV[3] the dead
         taker's token, ARGV[4] its taken member, ARGV[5] the score to queue it at,
         ARGV[6] the tenant: queued again (once), its token no longer counts
"dequeue" KEYS queued, waiting; ARGV[2] eid, ARGV[3] the tenant: out of the queue (a
         cancel); returns 1 when it was queued
"ahead"  KEYS queued, waiting; ARGV[2] eid, ARGV[3] the tenant: an estimate of how many
         executions start before it (its place in its tenant's line times the tenants
         waiting, plus the tenants served before its own), or -1 when not queued
Any other ARGV[1]: error "MODE <op>".
]]

local op = ARGV[1]
local now = now_ms()
-- queue.py's CONTINUATION_OFFSET_MS: a continuation's score is its time minus this.
local CONTINUATION_OFFSET_MS = 10000000000000

-- How many of `running`'s members are running ownerships (not paused entries), once
-- stale entries went; stops counting at `limit`.
local function running_now(running, grace, limit)
  redis.call("ZREMRANGEBYSCORE", running, "-inf", now - grace)
  local total = redis.call("ZCARD", running)
  if limit <= 0 or total < limit then
    return total
  end
  local count = 0
  for _, member in ipairs(redis.call("ZRANGE", running, 0, -1)) do
    if string.sub(member, 1, 7) ~= "paused:" then
      count = count + 1
    end
  end
  return count
end

local function wait_in_line(waiting, fair, tenant)
  if not redis.call("ZSCORE", waiting, tenant) then
    -- A tenant that returns gets no credit for its idle time: it starts at the clock.
    local clock = tonumber(redis.call("HGET", fair, "clock")) or 0
    redis.call("ZADD", waiting, clock, tenant)
  end
end

-- One more admission of `tenant` (a run started): its drain rate's counts.
local function served(fair, tenant)
  local began = tonumber(redis.call("HGET", fair, "dw:" .. tenant)) or 0
  if now - began >= 60000 then
    local last = 0
    if now - began < 120000 then
      last = tonumber(redis.call("HGET", fair, "dn:" .. tenant)) or 0
    end
    redis.call("HSET", fair, "dw:" .. tenant, now, "dn:" .. tenant, 0, "dp:" .. tenant, last)
  end
  redis.call("HINCRBY", fair, "dn:" .. tenant, 1)
end

-- Seconds until a refused tenant may find room: a minute over its admissions in the
-- last one to two minutes (1 to 60).
local function retry_after(fair, tenant)
  local began = tonumber(redis.call("HGET", fair, "dw:" .. tenant)) or 0
  local count = tonumber(redis.call("HGET", fair, "dn:" .. tenant)) or 0
  local span = (now - began) / 1000
  if now - began < 120000 then
    count = count + (tonumber(redis.call("HGET", fair, "dp:" .. tenant)) or 0)
    span = span + 60
  end
  if count <= 0 or span > 180 then
    return 60
  end
  return math.max(1, math.min(60, math.floor(span / count + 0.5)))
end

local function ahead_of(queued, waiting, eid, tenant)
  local rank = redis.call("ZRANK", queued, eid)
  if not rank then
    return -1
  end
  local tenants = redis.call("ZCARD", waiting)
  local before = redis.call("ZRANK", waiting, tenant) or 0
  return rank * math.max(tenants, 1) + before
end

if op == "enter" then
  local running, queued, waiting, fair = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local eid, token = ARGV[2], ARGV[3]
  local lease, grace = tonumber(ARGV[4]), tonumber(ARGV[5])
  local most, most_running = tonumber(ARGV[6]), tonumber(ARGV[7])
  local tenant = ARGV[9]
  local runs = running_now(running, grace, most_running)
  local unfinished = redis.call("ZCARD", running) + redis.call("ZCARD", queued)
  if most > 0 and unfinished >= most then
    return {0, retry_after(fair, tenant)}
  end
  local free = most_running <= 0 or runs < most_running
  if ARGV[8] == "1" and free and redis.call("ZCARD", waiting) == 0 then
    redis.call("ZADD", running, now + lease, token)
    served(fair, tenant)
    return {1}
  end
  redis.call("ZADD", queued, "NX", now, eid)
  wait_in_line(waiting, fair, tenant)
  return {2, ahead_of(queued, waiting, eid, tenant)}
elseif op == "take" then
  local waiting, fair, taken = KEYS[1], KEYS[2], KEYS[3]
  local token, lease, grace = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  local most_running, default_weight = tonumber(ARGV[5]), tonumber(ARGV[6])
  local best, best_time = nil, nil
  for i = 7, #ARGV do
    local tenant = ARGV[i]
    local vtime = tonumber(redis.call("ZSCORE", waiting, tenant))
    local running, queued = KEYS[2 + 2 * (i - 6)], KEYS[3 + 2 * (i - 6)]
    if vtime and (not best_time or vtime < best_time) then
      if redis.call("ZCARD", queued) == 0 then
        redis.call("ZREM", waiting, tenant) -- emptied by a cancel: nothing to serve
      elseif most_running <= 0 or running_now(running, grace, most_running) < most_running then
        best, best_time = i, vtime
      end
    end
  end
  if not best then
    return {}
  end
  local tenant = ARGV[best]
  local running, queued = KEYS[2 + 2 * (best - 6)], KEYS[3 + 2 * (best - 6)]
  local head = redis.call("ZRANGE", queued, 0, 0, "WITHSCORES")
  local eid, score = head[1], head[2]
  redis.call("ZREM", queued, eid)
  redis.call("ZADD", running, now + lease, token)
  local member = eid .. " " .. token .. " " .. score .. " " .. tenant
  -- A lease without a claim (it takes milliseconds): its taker is presumed dead, and a
  -- janitor queues it again.
  redis.call("ZADD", taken, now + lease, member)
  served(fair, tenant)
  local weight = tonumber(redis.call("HGET", fair, "w:" .. tenant)) or default_weight
  redis.call("HSET", fair, "clock", best_time)
  if redis.call("ZCARD", queued) == 0 then
    redis.call("ZREM", waiting, tenant)
  else
    redis.call("ZADD", waiting, best_time + 1 / weight, tenant)
  end
  return {eid, tenant, score, member}
elseif op == "room" then
  local most_running = tonumber(ARGV[5])
  local runs = running_now(KEYS[1], tonumber(ARGV[4]), most_running)
  if most_running > 0 and runs >= most_running then
    return 0
  end
  redis.call("ZADD", KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  return 1
elseif op == "line" then
  local running, queued, waiting, fair = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local eid, tenant = ARGV[2], ARGV[3]
  if ARGV[4] ~= "" then
    redis.call("ZREM", running, ARGV[4])
  end
  -- Continuations first: below every start's score (a time in ms), oldest first.
  redis.call("ZADD", queued, "NX", now - CONTINUATION_OFFSET_MS, eid)
  wait_in_line(waiting, fair, tenant)
  return ahead_of(queued, waiting, eid, tenant)
elseif op == "again" then
  if redis.call("ZSCORE", KEYS[1], ARGV[2]) then
    return 0
  end
  redis.call("ZADD", KEYS[1], tonumber(ARGV[4]), ARGV[2])
  wait_in_line(KEYS[2], KEYS[3], ARGV[3])
  return 1
elseif op == "claimed" then
  return redis.call("ZREM", KEYS[1], ARGV[2])
elseif op == "stale" then
  return redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", now, "LIMIT", 0, tonumber(ARGV[2]))
elseif op == "requeue" then
  local running, queued, waiting, fair, taken = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
  if redis.call("ZREM", taken, ARGV[4]) == 0 then
    return 0 -- requeued already by another janitor, or claimed meanwhile
  end
  redis.call("ZREM", running, ARGV[3])
  redis.call("ZADD", queued, "NX", tonumber(ARGV[5]), ARGV[2])
  wait_in_line(waiting, fair, ARGV[6])
  return 1
elseif op == "dequeue" then
  local removed = redis.call("ZREM", KEYS[1], ARGV[2])
  if redis.call("ZCARD", KEYS[1]) == 0 then
    redis.call("ZREM", KEYS[2], ARGV[3])
  end
  return removed
elseif op == "ahead" then
  return ahead_of(KEYS[1], KEYS[2], ARGV[2], ARGV[3])
end
return redis.error_reply("MODE " .. op)
