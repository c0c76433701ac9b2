--[[
renew.lua: extend the owner's lease.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta
ARGV[1]  the owner's fencing token
ARGV[2]  the new lease end, in milliseconds since the epoch

Returns "1" when a cancel was requested for the execution, else "0"; an error reply
"FENCED" when the token is no longer the owner's (or the execution is gone).
]]

local owner = redis.call("HGET", KEYS[1], "owner")
if owner ~= ARGV[1] then
  return redis.error_reply("FENCED")
end
redis.call("HSET", KEYS[1], "leaseUntil", ARGV[2])
return redis.call("HGET", KEYS[1], "cancelRequested") or "0"
