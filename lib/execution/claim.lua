--[[
claim.lua: move an execution's ownership, atomically with the status check.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta

ARGV[1]  mode:
           "resume"   paused -> running, owned by the caller (a human answered)
           "cancel"   running: flag cancelRequested for the owner and return;
                      paused -> running, owned by the caller, who writes the cancel
           "takeover" running with an expired lease -> owned by the caller
           "expire"   paused past its approval deadline -> running, owned by the caller
ARGV[2]  the caller's new fencing token
ARGV[3]  now, in milliseconds since the epoch
ARGV[4]  lease length in milliseconds
ARGV[5]  resume only: the paused block the caller answers ("" = whichever it is)

Returns {lastId, statusBefore, owner} on success, or an error reply:
  "NOEXEC"          no such execution (or it expired)
  "STATUS <status>" the execution is not in a state this mode applies to
  "BLOCK <blockId>" resume names a block the execution is not paused at
  "LEASE"           takeover: the lease has not expired
  "NOTDUE"          expire: the deadline has not passed
A new owner token in `owner` fences the previous owner out of append.lua.
]]

local meta = KEYS[1]
local mode, token = ARGV[1], ARGV[2]
local now, lease = tonumber(ARGV[3]), tonumber(ARGV[4])

local state = redis.call("HMGET", meta, "status", "lastId", "owner", "leaseUntil",
  "pauseBlock", "pauseDeadline")
local status = state[1]
if not status then
  return redis.error_reply("NOEXEC")
end
local last = tonumber(state[2]) or 0

local function own()
  redis.call("HSET", meta, "owner", token, "leaseUntil", now + lease, "status", "running",
    "pauseBlock", "", "pauseDeadline", "")
  return {last, status, token}
end

if mode == "resume" then
  if status ~= "paused" then
    return redis.error_reply("STATUS " .. status)
  end
  if ARGV[5] ~= "" and ARGV[5] ~= state[5] then
    return redis.error_reply("BLOCK " .. (state[5] or ""))
  end
  return own()
elseif mode == "cancel" then
  if status == "running" then
    redis.call("HSET", meta, "cancelRequested", "1")
    return {last, status, state[3]}
  end
  if status ~= "paused" then
    return redis.error_reply("STATUS " .. status)
  end
  return own()
elseif mode == "takeover" then
  if status ~= "running" then
    return redis.error_reply("STATUS " .. status)
  end
  if (tonumber(state[4]) or 0) >= now then
    return redis.error_reply("LEASE")
  end
  return own()
elseif mode == "expire" then
  if status ~= "paused" then
    return redis.error_reply("STATUS " .. status)
  end
  local deadline = tonumber(state[6])
  if not deadline or deadline > now then
    return redis.error_reply("NOTDUE")
  end
  return own()
end
return redis.error_reply("MODE " .. mode)
