--[[
store.lua: notice that the data now answers from another Redis server than the one
that wrote it (a restart from AOF or an older snapshot, a replica promoted), say how
long ownership must wait for owners to re-assert what that server may have lost, and
whether it lost writes some process saw acknowledged.

KEYS[1]  fc:store  (hash: runId, settleUntil, mark, behindUntil, nodes, born,
         restoredAt)
ARGV[1]  the identity of the server(s) answering now (run ids)
ARGV[2]  how long to settle after a change, in milliseconds
ARGV[3]  the highest mark this store ever gave the caller ("0": none yet)
ARGV[4]  how long approval deadlines wait after the store was found behind, in
         milliseconds (about a lease: the owners' time to re-assert what it lost)
ARGV[5]  (optional) on a cluster, the identity of every primary: another one there
         is the change (a node restarted), whatever ARGV[1] says; recorded the first
         time without one (processes of an earlier version send none, and are told
         of a change by ARGV[1] alone)

The mark is the store's own time of its latest call (of a caller that saw one; Redis's
clock, never lower than the mark before): a process remembers the highest one it was
given. A store whose mark is below a caller's came back without writes that process
saw acknowledged (an older snapshot, a lagging replica promoted): it is behind, and
for ARGV[4] from then on the approval deadlines it holds may not expire, for a pause
it brought back may have been resumed and its owner, stalled for a moment, not yet
told it so (the janitors read the wait and hold the deadlines listed when they first
see it).
A restart that lost nothing keeps its mark: deadlines fire at once after it.

When it was last found behind is kept (restoredAt, Redis's clock): an execution no owner
wrote since (its writtenAt is older: append.lua) is as that store brought it back, and
may have ended (or shown ids) since in a way only what its owners recorded outside the
store knows (takeovers.py ``recall``, asked by every claim of such an execution however
long after).

Returns {settle, behind, mark, restoredAt}: the milliseconds left to settle (0: claims
and janitors may go on; ARGV[2] when the identity just changed, what is left of that
settle while it has not), the milliseconds left for deadlines to wait (0: none), the
mark to remember, and when the store was last found behind (0: never). No error reply of its own. A store without the key is new or
came back empty. A new one (the caller saw no mark) has nothing to settle and is not
behind: (0, 0, and the identity is recorded). One that came back empty (the caller saw
a mark) settles, as a restart that kept its data does, and is behind for ARGV[4] like
an older snapshot: what a process kept is stored again into it (a pause, an ending:
finals.py) and may be older than what another did since (resumed that pause, on a run
that re-asserts itself within the settle; a resume claimed before that was a second
one accepted: the fresh-eyes review of e37bdfa), and ids owners showed are forgotten.

A caller that saw no mark (a process just started) cannot tell, so it hides nothing
from those that can: it is given the store's mark as it is, without raising it to now
(raised, it would stand above every mark the others saw before an older snapshot was
restored), and a key it creates records when ("born"): the first caller whose mark is
older than that saw the store before it came back empty, and finds it behind.
]]

local now = now_ms()
local known = redis.call("HMGET", KEYS[1], "runId", "settleUntil", "mark", "behindUntil",
  "nodes", "born", "restoredAt")
local nodes = ARGV[5] or ""
local seen = tonumber(ARGV[3]) or 0
if not known[1] then
  local mark = math.max(now, seen)
  local settle, behind, settle_until, behind_until = 0, 0, 0, 0
  if seen > 0 then
    settle, behind = tonumber(ARGV[2]), tonumber(ARGV[4])
    settle_until, behind_until = now + settle, now + behind
  end
  redis.call("HSET", KEYS[1], "runId", ARGV[1], "settleUntil", settle_until, "mark", mark,
    "behindUntil", behind_until)
  if nodes ~= "" then
    redis.call("HSET", KEYS[1], "nodes", nodes)
  end
  if seen == 0 then
    redis.call("HSET", KEYS[1], "born", now)
  end
  if seen > 0 then
    redis.call("HSET", KEYS[1], "restoredAt", now)
    return {settle, behind, mark, now}
  end
  return {settle, behind, mark, 0}
end
local settle_until = tonumber(known[2]) or 0
local mark = tonumber(known[3]) or 0
local behind_until = tonumber(known[4]) or 0
local changed = known[1] ~= ARGV[1]
if nodes ~= "" and known[5] then
  -- On a cluster the run ids of every primary say whether a node changed; ARGV[1], the
  -- run id of the caller's default node, says nothing more, and differs between
  -- processes whose clients chose other default nodes (a client picks one again each
  -- time it reads the slots, e.g. after a CLUSTERDOWN): two such processes, each
  -- calling its own "a change", kept the settle from ever ending, and no lease was
  -- swept nor any ownership moved again. It is recorded only with a change, so a
  -- caller that sends no nodes (an earlier version) finds the same one each time.
  changed = known[5] ~= nodes
end
if changed then
  settle_until = now + tonumber(ARGV[2])
  redis.call("HSET", KEYS[1], "runId", ARGV[1], "settleUntil", settle_until)
end
if nodes ~= "" and known[5] ~= nodes then
  redis.call("HSET", KEYS[1], "nodes", nodes)
end
local born = tonumber(known[6])
local emptied = born and seen > 0 and seen < born
local restored_at = tonumber(known[7]) or 0
if mark < seen or emptied then
  behind_until, restored_at = now + tonumber(ARGV[4]), now
  redis.call("HSET", KEYS[1], "behindUntil", behind_until, "restoredAt", now)
end
if emptied then
  -- Found: the others are told what is left; it settles from now (the process that
  -- made the key could not tell).
  redis.call("HDEL", KEYS[1], "born")
  if settle_until < now + tonumber(ARGV[2]) then
    settle_until = now + tonumber(ARGV[2])
    redis.call("HSET", KEYS[1], "settleUntil", settle_until)
  end
end
if seen > 0 then
  mark = math.max(mark, seen, now)
  redis.call("HSET", KEYS[1], "mark", mark)
end
return {math.max(settle_until - now, 0), math.max(behind_until - now, 0), mark, restored_at}
