--[[
store.lua: notice that the data now answers from another Redis server than the one
that wrote it (a restart from AOF or an older snapshot, a replica promoted), and say
how long ownership must wait for owners to re-assert what that server may have lost.

KEYS[1]  fc:store  (hash: runId, settleUntil)
ARGV[1]  the identity of the server(s) answering now (run ids)
ARGV[2]  how long to settle after a change, in milliseconds

Returns the milliseconds left to settle (0: claims and janitors may go on): ARGV[2]
when the identity just changed, what is left of that settle while it has not; no error
reply of its own. A store without the key is new or came back empty: nothing in it can
have been forgotten (an execution it lost is gone, and only its owner may bring it
back), so it has nothing to settle (0, and the identity is recorded).
]]

local now = now_ms()
local known = redis.call("HMGET", KEYS[1], "runId", "settleUntil")
if not known[1] then
  redis.call("HSET", KEYS[1], "runId", ARGV[1], "settleUntil", 0)
  return 0
end
if known[1] ~= ARGV[1] then
  redis.call("HSET", KEYS[1], "runId", ARGV[1], "settleUntil", now + tonumber(ARGV[2]))
  return tonumber(ARGV[2])
end
return math.max((tonumber(known[2]) or 0) - now, 0)
