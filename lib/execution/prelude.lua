--[[
prelude.lua: the helpers Flowcast's scripts share, written once.

Not a script of its own: lib/backend.py's `register` puts this text in front of every
script it registers (after a first `#!lua` line, which must stay first), so a script
calls these as if it defined them. A script of another package gets it the same way:
register it with `register(redis, __package__, "name.lua")` instead of
`redis.register_script(load_script(...))`.

Only `local function`s: a script may not set globals, and a helper a script does not
call costs it nothing (Redis keeps each script by its SHA, so this text is sent once
per script, never per call). No helper touches a key or a channel that does not come
in as an argument.
]]

-- Redis's clock in milliseconds, never a host's: a replica whose clock is off can then
-- neither end a healthy lease nor keep a dead one.
local function now_ms()
  local time = redis.call("TIME")
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- An owner the store forgot (it came back from an older snapshot) takes its execution
-- back: `epoch` is above the stored one, so no later owner can have claimed it.
local function take_back(meta, token, epoch)
  redis.call("HSET", meta, "owner", token, "epoch", epoch, "status", "running",
    "pauseBlock", "", "pauseDeadline", "")
end

-- Publish an execution's list row on `channel` as JSON {"id", "tenant", "workflowId",
-- "status", "createdAt", "updatedAt", "lastEventId"} (the live lists, listing.py), read
-- from its metadata hash `meta`, with "errorCode" when it failed (its error's code, such
-- as "quarantined"), and "decision" once an approval was rejected; nothing when the hash names no tenant. With pcall: the
-- caller has written by now and a script stopped by an error keeps its writes, so a
-- refused PUBLISH (an ACL without the channel) must not turn what was stored into an
-- error reply. The lists read the store again whenever they may have missed a row.
local function publish_row(meta, channel, execution_id, status, last_id)
  local row = redis.call("HMGET", meta, "tenant", "workflowId", "createdAt", "updatedAt",
    "error", "decision")
  if row[1] then
    local message = {id = execution_id, tenant = row[1], workflowId = row[2] or "",
      status = status, createdAt = row[3] or "", updatedAt = row[4] or "",
      lastEventId = last_id}
    if status == "failed" and row[5] then
      local ok, err = pcall(cjson.decode, row[5])
      if ok and type(err) == "table" and type(err.code) == "string" then
        message.errorCode = err.code
      end
    end
    if row[6] then message.decision = row[6] end
    redis.pcall("PUBLISH", channel, cjson.encode(message))
  end
end

