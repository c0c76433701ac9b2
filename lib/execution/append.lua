--[[
append.lua: append one ordered batch of events to an execution's replay buffer.

KEYS[1]  the execution's event stream    fc:{<eid>}:events
KEYS[2]  the execution's metadata hash   fc:{<eid>}:meta
KEYS[3]  the execution's dropped ranges  fc:{<eid>}:dropped  (sorted set, score = first id)
KEYS[4]  the execution's run state       fc:{<eid>}:state    (its checkpoint fields are
                                                             set here, with their events)
KEYS[5]  its revoked deliveries (claim.lua)  fc:{<eid>}:revoked  (only its TTL is set here)

ARGV[1]  fencing token of the writer; must equal the hash's `owner` field
ARGV[2]  the writer's epoch (the `epoch` its claim gave it)
ARGV[3]  id of the batch's first event (for an empty batch: the id after the writer's
         last stored one); must be the stored `lastId` + 1, unless ARGV[4] says the
         ids in between were dropped (by the writer, or lost by the store)
ARGV[4]  "1" when the ids between `lastId` and the batch are dropped: they are
         recorded as one dropped range "<from>-<to>", atomically with the batch
ARGV[5]  event limit (events retained)
ARGV[6]  byte budget (bytes retained, counted as the stored envelope sizes)
ARGV[7]  retention TTL in seconds, applied to every key once the batch finishes the
         execution (it sets a terminal status)
ARGV[8]  TTL in seconds while the execution is not finished (running or paused)
ARGV[9]  the highest id the writer wants reserved (it may show ids up to the reserved
         one to live readers; a new owner numbers above it)
ARGV[10] "1" to recreate the metadata when it is missing (the store came back empty)
ARGV[11] n, the number of events in the batch (0: a repair that only re-asserts)
ARGV[12] m, the number of metadata field/value pairs that follow the events
ARGV[13] k, the number of checkpoint field/value pairs that follow the metadata
ARGV[14] the execution id (what the messages below carry)
ARGV[15] the notify channel  fc:notify  (pub/sub, not a key)
ARGV[16] the status channel  fc:status  (pub/sub, not a key)
ARGV[17] inline cap: a batch whose envelopes add up to at most this many bytes is
         published on ARGV[15] whole (0: never)
ARGV[18] quota step: the execution's footprint (retained envelope bytes + `ckptBytes` +
         `copiedBytes`, the outcomes its metadata copies, + `quotaBase`, its run state
         as created) is handed to its tenant's storage ledger
         (lib/quota.lua, another slot: the caller sets it) when the batch sets the
         status, when it was never handed (`quotaRecorded` missing), or when it moved by
         this many bytes since `quotaRecorded` (0: never)
ARGV[19 .. 18+2n]        per event: type, envelope JSON
ARGV[19+2n .. 18+2n+2m]  metadata fields and values to set (status, output, error, …;
                         with ARGV[10], also the identity fields to recreate with)
ARGV[19+2n+2m .. ]       checkpoint fields and values of the batch's events (a block's
                         output, skip, attempt, answer), set in the run state hash in
                         the same step as the events, so the two never disagree; the
                         outputs and answers count against the byte budget (`ckptBytes`)

Publishes on ARGV[15] after every stored batch: the execution id alone (the readers'
wake-up: they read the store), or, for a batch within the inline cap, the batch itself
as lines "<execution id>\n<first id>\n<type>\n<envelope>\n<type>\n<envelope>…" (a
reader on another process forwards those events without reading them back; envelopes
are JSON, which holds no raw newline); and, when the batch sets the status (paused, resumed, recovered, a terminal event; never
a batch of chunks) and the metadata names a tenant, the execution's list row on ARGV[16]
as JSON {"id", "tenant", "workflowId", "status", "createdAt", "updatedAt",
"lastEventId"} (the live lists; the last id orders the changes of one execution). Both
best effort: a refused PUBLISH is no error, the batch is stored.

Returns {lastId, firstId, retainedBytes, retainedCount, reserved, cancelRequested,
footprint, tenant} (cancelRequested "1" or "0"; reserved is lastId once the status is
set to anything but running; footprint -1 and tenant "" unless the ledger is due its
figure, by ARGV[18]: then `quotaRecorded` is set to it here), or an error reply (no
event, metadata or checkpoint field of the batch is written; only a recreate or a
take-back, below, done before an ORDER or CANCEL refusal stays):
  "NOEXEC"          the metadata hash does not exist (and ARGV[10] is not "1")
  "FENCED <owner>"  another owner with the same or a later epoch holds the execution
                    (<owner> empty, "FENCED ", when it was handed off and nobody
                    took it over yet)
  "ORDER <lastId>"  the batch does not follow the stored last id
  "CANCEL"          a cancel was accepted before this batch's final event (paused or a
                    terminal other than cancelled): the writer must end with
                    `execution:cancelled` instead

A writer whose epoch is above the stored one is the owner the store forgot (it came
back from an older snapshot): the batch takes the execution back. Eviction trims the
oldest events until both bounds hold again, but never the newest event. Because the
status is set here, with the events, a reader that sees a terminal status also sees
every event before the terminal one.
]]

-- HSET in slices: Lua unpacks at most ~8000 values at once, and an error past the
-- first write would leave the batch half applied (a script keeps what it wrote). A
-- checkpoint written back whole after the store lost writes has two fields per block.
local function hset(key, fields)
  for i = 1, #fields, 1000 do
    redis.call("HSET", key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

local stream, meta, dropped = KEYS[1], KEYS[2], KEYS[3]
local token, epoch = ARGV[1], tonumber(ARGV[2])
local first = tonumber(ARGV[3])
local after_drop = ARGV[4] == "1"
local limit, budget = tonumber(ARGV[5]), tonumber(ARGV[6])
local retention, ttl = tonumber(ARGV[7]), tonumber(ARGV[8])
local reserve = tonumber(ARGV[9])
local recreate = ARGV[10] == "1"
local n, m, k = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local execution_id, notify, status_channel = ARGV[14], ARGV[15], ARGV[16]
local inline = tonumber(ARGV[17])
local quota_step = tonumber(ARGV[18])
local base = 18

local state = redis.call("HMGET", meta, "owner", "lastId", "firstId", "bytes", "count",
  "epoch", "reserved", "cancelRequested", "ckptBytes", "tenant", "quotaBase", "quotaRecorded",
  "copiedBytes")
if not state[1] then
  if not recreate then
    return redis.error_reply("NOEXEC")
  end
  state = {token, "0", "0", "0", "0", tostring(epoch), "0", false}
  redis.call("HSET", meta, "owner", token, "epoch", epoch, "status", "running",
    "lastId", 0, "firstId", 0, "bytes", 0, "count", 0)
elseif state[1] ~= token then
  if (tonumber(state[6]) or 0) >= epoch then
    return redis.error_reply("FENCED " .. state[1])
  end
  take_back(meta, token, epoch)
end

local last = tonumber(state[2]) or 0
if first ~= last + 1 and not (after_drop and first > last + 1) then
  return redis.error_reply("ORDER " .. last)
end
local cancel_requested = state[8] or "0"
if n > 0 and cancel_requested == "1" then
  local final = ARGV[base + 2 * (n - 1) + 1]
  if final == "execution:paused" or final == "execution:completed" or final == "execution:failed" then
    return redis.error_reply("CANCEL")
  end
end
if first > last + 1 then
  redis.call("ZADD", dropped, last + 1, (last + 1) .. "-" .. (first - 1))
end

local first_kept = tonumber(state[3]) or 0
local bytes = tonumber(state[4]) or 0
local count = tonumber(state[5]) or 0
-- Outputs and answers the checkpoint holds count against the budget too: the ring
-- evicts its oldest events to make room for them (they are never evicted).
local held = tonumber(state[9]) or 0
for i = 1, k do
  local field = ARGV[base + 2 * n + 2 * m + 2 * i - 1]
  local kind = string.sub(field, 1, 2)
  if kind == "o:" or kind == "a:" then
    held = held + #ARGV[base + 2 * n + 2 * m + 2 * i]
  end
end

for i = 0, n - 1 do
  local body = ARGV[base + 2 * i + 2]
  redis.call("XADD", stream, (first + i) .. "-0", "t", ARGV[base + 2 * i + 1], "e", body)
  bytes = bytes + #body
  count = count + 1
end
last = first + n - 1
if n > 0 and count == n then
  first_kept = first
end

-- Evict the oldest events while either bound is passed, keeping the newest one.
while count > 1 and (count > limit or bytes + held > budget) do
  local oldest = redis.call("XRANGE", stream, "-", "+", "COUNT", math.min(count - 1, 256))
  local evict_to = nil
  for _, entry in ipairs(oldest) do
    if not (count > 1 and (count > limit or bytes + held > budget)) then
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

local reserved = math.max(tonumber(state[7]) or 0, reserve, last)
local status = nil
-- The outcomes the metadata copies (small ones; a large one names its event instead).
local copied = tonumber(state[13]) or 0
local COPIES = {output = true, error = true, pause = true}
if m > 0 then
  local fields = {}
  for i = 1, 2 * m do
    fields[i] = ARGV[base + 2 * n + i]
    if i % 2 == 0 and COPIES[fields[i - 1]] then
      copied = copied + #fields[i] - redis.call("HSTRLEN", meta, fields[i - 1])
    end
    if i % 2 == 0 and fields[i - 1] == "status" then
      status = fields[i]
      if status ~= "running" then
        -- Paused or finished: nothing more is shown before it is stored.
        reserved = last
        if status ~= "paused" then
          ttl = retention
        end
      end
    end
  end
  hset(meta, fields)
  redis.call("HSET", meta, "copiedBytes", copied)
end
-- The tenant's ledger is due this execution's figure (lib/quota.lua, set by the caller).
local footprint, tenant = -1, ""
if quota_step > 0 and state[10] then
  local now_footprint = bytes + held + copied + (tonumber(state[11]) or 0)
  local recorded = tonumber(state[12])
  if status or not recorded or math.abs(now_footprint - recorded) >= quota_step then
    footprint, tenant = now_footprint, state[10]
  end
end
-- writtenAt: when an owner last wrote (Redis's clock): a run not written since the store
-- came back behind is one whose end may have been lost (store.lua restoredAt).
redis.call("HSET", meta, "lastId", last, "firstId", first_kept, "bytes", bytes, "count", count,
  "reserved", reserved, "ckptBytes", held, "writtenAt", now_ms())
if footprint >= 0 then
  redis.call("HSET", meta, "quotaRecorded", footprint)
end
if k > 0 then
  local fields = {}
  for i = 1, 2 * k do
    fields[i] = ARGV[base + 2 * n + 2 * m + i]
  end
  hset(KEYS[4], fields)
end
for _, key in ipairs(KEYS) do
  redis.call("EXPIRE", key, ttl)
end
-- Wake the readers following this execution in every process (a channel is no key,
-- so this also works on Redis Cluster). With pcall, as publish_row: the batch is
-- written by now, and a refused PUBLISH must not turn it into an error reply. Messages
-- are best-effort anyway: readers read the store again whenever they may have missed one.
local message = execution_id
if n > 0 and inline > 0 then
  local size = 0
  for i = 0, n - 1 do
    size = size + #ARGV[base + 2 * i + 2]
  end
  if size <= inline then
    local parts = {execution_id, string.format("%d", first)}
    for i = 0, n - 1 do
      parts[#parts + 1] = ARGV[base + 2 * i + 1]
      parts[#parts + 1] = ARGV[base + 2 * i + 2]
    end
    message = table.concat(parts, "\n")
  end
end
redis.pcall("PUBLISH", notify, message)
if status then
  -- A handful of times per execution: the row every live list of its tenant shows.
  publish_row(meta, status_channel, execution_id, status, last)
end
return {last, first_kept, bytes, count, reserved, cancel_requested, footprint, tenant}
