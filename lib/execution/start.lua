--[[
start.lua: create a new execution's metadata, owned by the caller, on Redis's clock.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta
ARGV[1]  the caller's fencing token
ARGV[2]  lease length in milliseconds
ARGV[3]  TTL in seconds while the execution is not finished
ARGV[4 ..]  field/value pairs: workflowId, tenant, createdAt, updatedAt, …

Returns the lease end in milliseconds. The execution starts `running` at epoch 1.
]]

local meta = KEYS[1]
local time = redis.call("TIME")
local until_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + tonumber(ARGV[2])
local fields = {"owner", ARGV[1], "epoch", 1, "leaseUntil", until_ms, "status", "running",
  "lastId", 0, "firstId", 0, "bytes", 0, "count", 0, "reserved", 0}
for i = 4, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call("HSET", meta, unpack(fields))
redis.call("EXPIRE", meta, ARGV[3])
return until_ms
