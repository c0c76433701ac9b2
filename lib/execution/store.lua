--[[
store.lua: notice that the data now answers from another Redis server than the one
that wrote it (a restart from AOF or an older snapshot, a replica promoted), say how
long ownership must wait for owners to re-assert what that server may have lost, and
whether it lost writes some process saw acknowledged.

KEYS[1]  fc:store  (hash: runId, settleUntil, mark, behindUntil, nodes)
ARGV[1]  the identity of the server(s) answering now (run ids)
ARGV[2]  how long to settle after a change, in milliseconds
ARGV[3]  the highest mark this store ever gave the caller ("0": none yet)
ARGV[4]  how long approval deadlines wait after the store was found behind, in
         milliseconds (about a lease: the owners' time to re-assert what it lost)
ARGV[5]  (optional) on a cluster, the identity of every primary: another one there
         is a change too (a node restarted), as ARGV[1] is; recorded the first time
         without one (processes of an earlier version send none)

The mark is the store's own time of its latest call (Redis's clock, never lower than
the mark before): a process remembers the highest one it was given. A store whose mark
is below a caller's came back without writes that process saw acknowledged (an older
snapshot, a lagging replica promoted): it is behind, and for ARGV[4] from then on the
approval deadlines it holds may not expire, for a pause it brought back may have been
resumed and its owner, stalled for a moment, not yet told it so (the janitors read the
wait and hold the deadlines listed when they first see it).
A restart that lost nothing keeps its mark: deadlines fire at once after it.

Returns {settle, behind, mark}: the milliseconds left to settle (0: claims and
janitors may go on; ARGV[2] when the identity just changed, what is left of that
settle while it has not), the milliseconds left for deadlines to wait (0: none), and
the mark to remember. No error reply of its own. A store without the key is new or
came back empty: it has nothing to settle (an execution it lost is gone, and only what
a process kept of it brings it back). A new one (the caller saw no mark) is not behind:
(0, 0, and the identity is recorded). One that came back empty (the caller saw a mark)
is behind for ARGV[4] like an older snapshot: ids owners showed are forgotten, and a
pause or an ending a process stores again into it is older than they are.
]]

local now = now_ms()
local known = redis.call("HMGET", KEYS[1], "runId", "settleUntil", "mark", "behindUntil",
  "nodes")
local nodes = ARGV[5] or ""
local seen = tonumber(ARGV[3]) or 0
if not known[1] then
  local mark = math.max(now, seen)
  local behind, behind_until = 0, 0
  if seen > 0 then
    behind = tonumber(ARGV[4])
    behind_until = now + behind
  end
  redis.call("HSET", KEYS[1], "runId", ARGV[1], "settleUntil", 0, "mark", mark,
    "behindUntil", behind_until)
  if nodes ~= "" then
    redis.call("HSET", KEYS[1], "nodes", nodes)
  end
  return {0, behind, mark}
end
local settle_until = tonumber(known[2]) or 0
local mark = tonumber(known[3]) or 0
local behind_until = tonumber(known[4]) or 0
local nodes_changed = nodes ~= "" and known[5] and known[5] ~= nodes
if known[1] ~= ARGV[1] or nodes_changed then
  settle_until = now + tonumber(ARGV[2])
  redis.call("HSET", KEYS[1], "runId", ARGV[1], "settleUntil", settle_until)
end
if nodes ~= "" and known[5] ~= nodes then
  redis.call("HSET", KEYS[1], "nodes", nodes)
end
if mark < seen then
  behind_until = now + tonumber(ARGV[4])
  redis.call("HSET", KEYS[1], "behindUntil", behind_until)
end
mark = math.max(mark, seen, now)
redis.call("HSET", KEYS[1], "mark", mark)
return {math.max(settle_until - now, 0), math.max(behind_until - now, 0), mark}
