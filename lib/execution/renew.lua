--[[
renew.lua: extend the owner's lease, on Redis's clock.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta
ARGV[1]  the owner's fencing token
ARGV[2]  the owner's epoch
ARGV[3]  lease length in milliseconds
ARGV[4]  the last id the owner stored (0 if unknown)

Returns {cancelRequested ("1" or "0"), leaseUntil} (the lease end it stored, in ms) or
an error reply:
  "GONE"    the metadata does not exist (the store came back empty): the owner's
            writer recreates it
  "FENCED"  another owner with the same or a later epoch holds the execution, or it
            was handed off (no owner) at such an epoch
  "BEHIND"  the stored last id is below what the owner stored: the store lost writes
            (an older snapshot); the owner's writer writes them back (as for GONE).
            The lease is renewed first.
An owner whose epoch is above the stored one is the owner a store restored from an
older snapshot forgot: it takes the execution back, as append.lua does.
]]

local meta = KEYS[1]
local token, epoch = ARGV[1], tonumber(ARGV[2])
local state = redis.call("HMGET", meta, "owner", "epoch", "cancelRequested", "lastId")
if not state[1] then
  return redis.error_reply("GONE")
end
if state[1] ~= token then
  if (tonumber(state[2]) or 0) >= epoch then
    return redis.error_reply("FENCED")
  end
  take_back(meta, token, epoch)
end
local until_ms = now_ms() + tonumber(ARGV[3])
redis.call("HSET", meta, "leaseUntil", until_ms)
if (tonumber(state[4]) or 0) < (tonumber(ARGV[4]) or 0) then
  return redis.error_reply("BEHIND")
end
return {state[3] or "0", until_ms}
