--[[
append.lua: append one ordered batch of events to an execution's replay buffer.

KEYS[1]  the execution's event stream    fc:{<eid>}:events
KEYS[2]  the execution's metadata hash   fc:{<eid>}:meta
KEYS[3]  the execution's dropped ranges  fc:{<eid>}:dropped  (sorted set, score = first id)
KEYS[4]  the execution's run state       fc:{<eid>}:state    (only its TTL is set here)

ARGV[1]  fencing token of the writer; must equal the hash's `owner` field
ARGV[2]  id of the batch's first event; must be the stored `lastId` + 1, unless ARGV[3]
         says the writer dropped the ids in between
ARGV[3]  "1" when the ids between `lastId` and the batch were dropped by the writer:
         they are recorded as one dropped range "<from>-<to>", atomically with the batch
ARGV[4]  event limit (events retained)
ARGV[5]  byte budget (bytes retained, counted as the stored envelope sizes)
ARGV[6]  retention TTL in seconds, applied to every key once the batch finishes the
         execution (it sets a terminal status)
ARGV[7]  TTL in seconds while the execution is not finished (running or paused)
ARGV[8]  n, the number of events in the batch
ARGV[9]  m, the number of metadata field/value pairs that follow the events
ARGV[10 .. 9+2n]         per event: type, envelope JSON
ARGV[10+2n .. 9+2n+2m]   metadata fields and values to set (status, output, error, …)

Returns {lastId, firstId, retainedBytes, retainedCount} on success, or an error reply:
  "NOEXEC"          the metadata hash does not exist (expired or never created)
  "FENCED <owner>"  the writer is not the current owner
  "ORDER <lastId>"  the batch does not follow the stored last id

Eviction trims the oldest events until both bounds hold again, but never the batch's
own last event: an execution always keeps its newest event, so a reader can tell where
the log ends. Because the status is set here, with the events, a reader that sees a
terminal status also sees every event before the terminal one.
]]

local stream, meta, dropped, run_state = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token = ARGV[1]
local first = tonumber(ARGV[2])
local after_drop = ARGV[3] == "1"
local limit = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
local retention = tonumber(ARGV[6])
local ttl = tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local m = tonumber(ARGV[9])

local state = redis.call("HMGET", meta, "owner", "lastId", "firstId", "bytes", "count")
if not state[1] then
  return redis.error_reply("NOEXEC")
end
if state[1] ~= token then
  return redis.error_reply("FENCED " .. state[1])
end
local last = tonumber(state[2]) or 0
if first ~= last + 1 and not (after_drop and first > last + 1) then
  return redis.error_reply("ORDER " .. last)
end
if first > last + 1 then
  redis.call("ZADD", dropped, last + 1, (last + 1) .. "-" .. (first - 1))
  redis.call("EXPIRE", dropped, ttl)
end

local first_kept = tonumber(state[3]) or 0
local bytes = tonumber(state[4]) or 0
local count = tonumber(state[5]) or 0

local base = 9
for i = 0, n - 1 do
  local body = ARGV[base + 2 * i + 2]
  redis.call("XADD", stream, (first + i) .. "-0", "t", ARGV[base + 2 * i + 1], "e", body)
  bytes = bytes + #body
  count = count + 1
end
last = first + n - 1
if count == n then
  first_kept = first
end

-- Evict the oldest events while either bound is passed, keeping the newest one.
while count > 1 and (count > limit or bytes > budget) do
  local oldest = redis.call("XRANGE", stream, "-", "+", "COUNT", math.min(count - 1, 256))
  local evict_to = nil
  for _, entry in ipairs(oldest) do
    if not (count > 1 and (count > limit or bytes > budget)) then
      break
    end
    local fields = entry[2]
    for j = 1, #fields, 2 do
      if fields[j] == "e" then
        bytes = bytes - #fields[j + 1]
      end
    end
    count = count - 1
    evict_to = entry[1]
  end
  if evict_to == nil then
    break
  end
  redis.call("XTRIM", stream, "MINID", (tonumber(string.match(evict_to, "^(%d+)")) + 1) .. "-0")
  local next_entry = redis.call("XRANGE", stream, "-", "+", "COUNT", 1)
  first_kept = tonumber(string.match(next_entry[1][1], "^(%d+)"))
end

redis.call("HSET", meta, "lastId", last, "firstId", first_kept, "bytes", bytes, "count", count)
if m > 0 then
  local fields = {}
  for i = 1, 2 * m do
    fields[i] = ARGV[base + 2 * n + i]
    if i % 2 == 0 and fields[i - 1] == "status" and
        (fields[i] == "completed" or fields[i] == "failed" or fields[i] == "cancelled") then
      ttl = retention
    end
  end
  redis.call("HSET", meta, unpack(fields))
end
for _, key in ipairs(KEYS) do
  redis.call("EXPIRE", key, ttl)
end
return {last, first_kept, bytes, count}
