--[[
renew.lua: extend the owner's lease, on Redis's clock.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta
ARGV[1]  the owner's fencing token
ARGV[2]  the owner's epoch
ARGV[3]  lease length in milliseconds

Returns {cancelRequested ("1" or "0"), leaseUntil} or an error reply:
  "GONE"    the metadata does not exist (the store came back empty): the owner's
            writer recreates it
  "FENCED"  another owner with the same or a later epoch holds the execution
An owner whose epoch is above the stored one is the owner a store restored from an
older snapshot forgot: it takes the execution back, as append.lua does.
]]

local meta = KEYS[1]
local token, epoch = ARGV[1], tonumber(ARGV[2])
local state = redis.call("HMGET", meta, "owner", "epoch", "cancelRequested")
if not state[1] then
  return redis.error_reply("GONE")
end
if state[1] ~= token then
  if (tonumber(state[2]) or 0) >= epoch then
    return redis.error_reply("FENCED")
  end
  redis.call("HSET", meta, "owner", token, "epoch", epoch, "status", "running",
    "pauseBlock", "", "pauseDeadline", "")
end
local time = redis.call("TIME")
local until_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + tonumber(ARGV[3])
redis.call("HSET", meta, "leaseUntil", until_ms)
return {state[3] or "0", until_ms}
