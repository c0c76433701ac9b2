--[[
start.lua: create a new execution's metadata, owned by the caller, on Redis's clock.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta
KEYS[2]  the execution's run state       fc:{<eid>}:state
ARGV[1]  the caller's fencing token; "" to create it `queued`, owned by nobody, with no
         lease and nothing reserved (a worker takes it: claim.lua "take")
ARGV[2]  lease length in milliseconds
ARGV[3]  TTL in seconds while the execution is not finished
ARGV[4]  the execution id (the `id` of the row published on ARGV[5])
ARGV[5]  the status channel  fc:status  (pub/sub, not a key)
ARGV[6]  the ids reserved for the new owner from the start (`reserved`): it shows its
         first events live as it emits them, before their append is acknowledged
         (append.lua then reserves as it goes; a takeover numbers above them)
ARGV[7]  n, the number of run state field/value pairs that follow (the workflow
         version and the input: what a recovery needs, there from the start)
ARGV[8 .. 7+2n]  run state fields and values (the run state is written, and given the
                 TTL, only when n > 0)
ARGV[8+2n ..]    metadata field/value pairs: workflowId, tenant, createdAt, updatedAt, …

Publishes the new execution's list row on ARGV[5] as JSON {"id", "tenant",
"workflowId", "status": "running", "createdAt", "updatedAt", "lastEventId": 0} (the live
lists; see append.lua for the other status changes), only when the metadata names a
tenant, and best effort: a refused PUBLISH is no error.

Returns the lease end in milliseconds (1 for a queued one, which has none). The
execution starts `running` at epoch 1 (or `queued` at epoch 0), with no events (lastId,
firstId, bytes and count 0), `reserved` ARGV[6] and `writtenAt` now (see append.lua). Returns 0 when
the execution exists already (its id was named in advance, by an Idempotency-Key's
record, and another request created it first): nothing is written and nothing is
published. No error reply of its own.
]]

local meta = KEYS[1]
if redis.call("EXISTS", meta) == 1 then
  return 0
end
local now = now_ms()
local until_ms = now + tonumber(ARGV[2])
local status, epoch, reserved = "running", 1, tonumber(ARGV[6])
if ARGV[1] == "" then
  status, epoch, reserved, until_ms = "queued", 0, 0, 1
end
local n = tonumber(ARGV[7])
local fields = {"owner", ARGV[1], "epoch", epoch, "leaseUntil", until_ms, "status", status,
  "lastId", 0, "firstId", 0, "bytes", 0, "count", 0, "reserved", reserved,
  "writtenAt", now}
for i = 8 + 2 * n, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call("HSET", meta, unpack(fields))
redis.call("EXPIRE", meta, ARGV[3])
if n > 0 then
  local state = {}
  for i = 8, 7 + 2 * n do
    state[#state + 1] = ARGV[i]
  end
  redis.call("HSET", KEYS[2], unpack(state))
  redis.call("EXPIRE", KEYS[2], ARGV[3])
end
-- The execution exists by now: a refused PUBLISH must not answer "failed" for it.
publish_row(meta, ARGV[5], ARGV[4], status, 0)
return until_ms
