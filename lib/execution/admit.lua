--[[
admit.lua: count a tenant's unfinished executions and admit one more if there is room.

KEYS[1]  the tenant's set  fc:running:<tenant>  (sorted set: the fencing token of each
         running ownership, scored by lease end, and "paused:<eid>" for each paused
         execution, scored by when its keys would expire)
ARGV[1]  the fencing token of the run to admit (one per ownership, so the cleanup of
         an earlier run of the same execution never removes a later one's entry)
ARGV[2]  its lease length in milliseconds
ARGV[3]  the most unfinished executions the tenant may have (0 = no limit)
ARGV[4]  a member the new run replaces ("paused:<eid>" for a resume; "" for none): it
         does not count, so a tenant at its cap can still resume its own pause
ARGV[5]  how long (ms) an entry goes on counting after its lease ended

Returns 1 when admitted (or already in: its score moves to the new lease end), 0 when
the tenant is at its limit (nothing is added); no error reply of its own. Entries
whose lease ended (on Redis's clock) longer than ARGV[5] ago are dropped first. A run
of a dead process goes on counting until a janitor takes its execution over (the new
owner counts instead, and the dead one's entry is removed then); past that grace it
stops counting even if nobody did, so a tenant is never refused for good.
]]

local key = KEYS[1]
local now = now_ms()
redis.call("ZREMRANGEBYSCORE", key, "-inf", now - tonumber(ARGV[5]))
local limit = tonumber(ARGV[3])
local count = redis.call("ZCARD", key)
if ARGV[4] ~= "" and redis.call("ZSCORE", key, ARGV[4]) then
  count = count - 1
end
if limit > 0 and not redis.call("ZSCORE", key, ARGV[1]) and count >= limit then
  return 0
end
local until_ms = now + tonumber(ARGV[2])
redis.call("ZADD", key, until_ms, ARGV[1])
return 1
