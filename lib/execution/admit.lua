--[[
admit.lua: count a tenant's running executions and admit one more if there is room.

KEYS[1]  the tenant's running set  fc:running:<tenant>  (sorted set, score = lease end)
ARGV[1]  the execution id to admit
ARGV[2]  now, in milliseconds since the epoch
ARGV[3]  its lease end, in milliseconds since the epoch
ARGV[4]  the most running executions the tenant may have (0 = no limit)

Returns 1 when admitted (or already in), 0 when the tenant is at its limit. Entries
whose lease ended are dropped first, so executions of a dead process stop counting
when their lease runs out, without anyone cleaning up after it.
]]

local key = KEYS[1]
redis.call("ZREMRANGEBYSCORE", key, "-inf", ARGV[2])
local limit = tonumber(ARGV[4])
if limit > 0 and not redis.call("ZSCORE", key, ARGV[1]) and redis.call("ZCARD", key) >= limit then
  return 0
end
redis.call("ZADD", key, ARGV[3], ARGV[1])
redis.call("PEXPIREAT", key, ARGV[3])
return 1
