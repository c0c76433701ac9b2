--[[
idempotency.lua: answer an Idempotency-Key's record once: store an outcome in place of
the pending record, unless another request answered it first.

KEYS[1]  the record   <prefix>:idem:<tenant>:<operation>:<sha256 of the key>
ARGV[1]  the pending record, as this request wrote or read it
ARGV[2]  the record with this request's outcome
ARGV[3]  its time to live in seconds

Returns the record as it is afterwards: ARGV[2] when it was stored, the record another
request answered first otherwise, nil when the record is gone (expired).
]]

local current = redis.call("GET", KEYS[1])
if current == ARGV[1] then
  redis.call("SET", KEYS[1], ARGV[2], "EX", ARGV[3])
  return ARGV[2]
end
return current
