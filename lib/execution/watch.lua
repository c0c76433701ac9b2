--[[
watch.lua: list a member in a watch list (a sorted set scored by a time), or read
the members that are due, on Redis's clock.

KEYS[1]  the watch list: fc:leases ("<eid> <fence>" by lease end),
         fc:deadlines (execution ids by approval deadline) or fc:running:<tenant>
ARGV[1]  "add": ARGV[2] member, ARGV[3] milliseconds from now, ARGV[4] (optional) a
                member it replaces, removed in the same step; returns the score
         "refresh": the same, but only for a member still listed (a renewal that
                arrives after its run left must not list it again); the score is
                returned, and ARGV[4] removed, whether or not the member was listed
         "at": ARGV[2] member, ARGV[3] a time (ms, Redis's clock), ARGV[4] milliseconds
                from now it may not be earlier than: scored at the later of the two
                (a pause restored into a store that forgot it: its deadline waits for
                an owner that resumed it to say so); returns the score
         "due": ARGV[2] the most members to return, ARGV[3] (optional) milliseconds
                to look ahead; returns the members whose score has passed (at most now,
                plus ARGV[3]), lowest first. Any other ARGV[1] reads as "due".
No error reply of its own.
]]

local now = now_ms()
if ARGV[1] == "add" or ARGV[1] == "refresh" then
  local score = now + tonumber(ARGV[3])
  if ARGV[1] == "refresh" then
    redis.call("ZADD", KEYS[1], "XX", score, ARGV[2])
  else
    redis.call("ZADD", KEYS[1], score, ARGV[2])
  end
  if ARGV[4] and ARGV[4] ~= "" then
    redis.call("ZREM", KEYS[1], ARGV[4])
  end
  return score
end
if ARGV[1] == "at" then
  local score = math.max(tonumber(ARGV[3]), now + tonumber(ARGV[4]))
  redis.call("ZADD", KEYS[1], score, ARGV[2])
  return score
end
local ahead = tonumber(ARGV[3]) or 0
return redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", now + ahead, "LIMIT", 0, tonumber(ARGV[2]))
