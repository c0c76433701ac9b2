--[[
start.lua: create a new execution's metadata, owned by the caller, on Redis's clock.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta
KEYS[2]  the execution's run state       fc:{<eid>}:state
ARGV[1]  the caller's fencing token
ARGV[2]  lease length in milliseconds
ARGV[3]  TTL in seconds while the execution is not finished
ARGV[4]  n, the number of run state field/value pairs that follow (the workflow
         version and the input: what a recovery needs, there from the start)
ARGV[5 .. 4+2n]  run state fields and values
ARGV[5+2n ..]    metadata field/value pairs: workflowId, tenant, createdAt, updatedAt, …

Publishes the new execution's list row on "<prefix>:status" as JSON {"id", "tenant",
"workflowId", "status", "createdAt", "updatedAt", "lastEventId": 0} (the live lists; see
append.lua for the other status changes), best effort: a refused PUBLISH is no error.

Returns the lease end in milliseconds. The execution starts `running` at epoch 1.
Returns 0 when the execution exists already (its id was named in advance, by an
Idempotency-Key's record, and another request created it first): nothing is written and
nothing is published.
]]

local meta = KEYS[1]
if redis.call("EXISTS", meta) == 1 then
  return 0
end
local time = redis.call("TIME")
local until_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + tonumber(ARGV[2])
local n = tonumber(ARGV[4])
local fields = {"owner", ARGV[1], "epoch", 1, "leaseUntil", until_ms, "status", "running",
  "lastId", 0, "firstId", 0, "bytes", 0, "count", 0, "reserved", 0}
for i = 5 + 2 * n, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call("HSET", meta, unpack(fields))
redis.call("EXPIRE", meta, ARGV[3])
if n > 0 then
  local state = {}
  for i = 5, 4 + 2 * n do
    state[#state + 1] = ARGV[i]
  end
  redis.call("HSET", KEYS[2], unpack(state))
  redis.call("EXPIRE", KEYS[2], ARGV[3])
end
local row = redis.call("HMGET", meta, "tenant", "workflowId", "createdAt", "updatedAt")
if row[1] then
  -- With pcall: the execution exists by now, and a refused PUBLISH (an ACL without the
  -- channel) must not answer "failed" for it (the lists read the store again anyway).
  local prefix, eid = string.match(meta, "^(.*):{(.*)}:meta$")
  redis.pcall("PUBLISH", prefix .. ":status", cjson.encode({id = eid, tenant = row[1],
    workflowId = row[2] or "", status = "running", createdAt = row[3] or "",
    updatedAt = row[4] or "", lastEventId = 0}))
end
return until_ms
