#!lua flags=no-writes
--[[
read.lua: a consistent read of an execution's buffer (events, metadata, dropped ranges).

KEYS[1]  the execution's event stream    fc:{<eid>}:events
KEYS[2]  the execution's metadata hash   fc:{<eid>}:meta
KEYS[3]  the execution's dropped ranges  fc:{<eid>}:dropped

ARGV[1]  the cursor: events with larger ids are returned
ARGV[2]  the most events to return

Returns {entries, metaFields, droppedRanges}: entries as XRANGE gives them, the hash as
HGETALL gives it (empty when the execution does not exist), and every dropped range as
"<from>-<to>", in order; no error reply of its own. One script rather than MULTI so it
also runs on Redis Cluster. Flagged no-writes (the first line, kept first when the
prelude is added): it runs while writes are paused (CLIENT PAUSE … WRITE, a failover),
so stream opens and replays go on.
]]

-- An exclusive start built from the cursor's own digits: Lua would print a large number
-- as "1e+14", which is not a stream id.
local entries = redis.call("XRANGE", KEYS[1], "(" .. ARGV[1] .. "-0", "+", "COUNT", ARGV[2])
return {entries, redis.call("HGETALL", KEYS[2]), redis.call("ZRANGE", KEYS[3], 0, -1)}
