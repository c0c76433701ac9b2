--[[
claim.lua: one transition of an execution's ownership, atomic with the status check.

KEYS[1]  the execution's metadata hash  fc:{<eid>}:meta
KEYS[2]  its run state hash (the checkpoint)  fc:{<eid>}:state
KEYS[3]  the fencing tokens of its revoked deliveries (a set)  fc:{<eid>}:revoked

ARGV[1]  transition:
           "resume"   paused -> running, owned by the caller (a human answered)
           "cancel"   running: flag cancelRequested for the owner and return;
                      paused or queued -> running, owned by the caller, who writes
                      the cancel (after execution:started, for a queued one)
                      (flagged too, for whoever takes it over if the caller dies)
           "takeover" running with an expired lease, or handed off -> owned by the
                      caller, who recovers it from its checkpoint
           "handoff"  running, owned by the caller (its fencing token): let go of it
                      now, for another process to take over (a shutdown)
           "expire"   paused past its approval deadline -> running, owned by the caller
           "take"     queued -> running, owned by the caller (a worker that took it
                      from the queue: queue.lua); its first ARGV[4] ids are reserved
                      for it, as start.lua reserves them. Refused REVOKED when its
                      delivery was revoked
           "revoke"   queued (or not created yet) -> queued: the delivery whose taker's
                      token is ARGV[2] is revoked (a janitor found it not claimed a
                      lease after it was taken, and queues it again): that taker's
                      "take" is refused from now on, however late it comes. Returns 1
                      (0 when the record is not there yet: the mark waits for it)
ARGV[2]  the caller's new fencing token (revoke: the token of the taker revoked)
ARGV[3]  lease length in milliseconds (revoke: how long the mark is kept)
ARGV[4]  resume: the paused block the caller answers ("" = whichever it is);
         takeover: the owner whose lease the caller found expired (or who handed off);
         handoff: the highest id the caller showed live (its reservation above that
         is handed back: the next owner numbers from there);
         take: the ids reserved for the new owner from the start (start.lua's ARGV[6])
ARGV[5]  resume: "queue" when the caller may not run it now (its tenant runs its cap,
         or the caller has no free worker slot): paused -> queued, owned by nobody,
         with `continues` naming the answered block; a worker takes it (queue.lua)
         and runs it on from the answer
         takeover: "handoff" to take it over only if its owner handed it off; "dead"
         to take it over from the owner ARGV[4] although its lease has not ended (the
         caller knows that owner is dead: an earlier process of its own node)
ARGV[6]  resume: the answer, as JSON. It goes into the checkpoint (`a:<block>`) with the
         claim, so the 202 holds even if the caller dies before it stores
         execution:resumed: whoever recovers the execution finds the block answered.
         (The caller's resumed event then writes the answer as kept, a ref when large.)
ARGV[7]  the base at least ("" or "0": none): the highest durable ceiling the
         execution's owners recorded outside Redis (ceiling.py), given when the store
         came back behind (an older snapshot), so that the new owner (of a takeover,
         resume, cancel or expiry) numbers above ids an owner that could not re-assert
         them showed live; the ids between the stored last id and the base are then
         reported dropped, as for any base
ARGV[8]  takeover: who the dead owner's death is charged to (blame.py reads it from the
         dead process's record): "alone" (or "": it ran nothing else, or left no record)
         counts a crash, as ever; "suspect" (it was the process's one suspect, beside
         others) counts a crash and quarantines it; "beside" (another run was the
         suspect) and "crowd" (several ran, none suspected) charge it nothing
ARGV[9]  takeover: "busy" when the caller runs a suspect already: a run whose owners
         died twice (this death counted) is refused SUSPECT, so that each process runs
         at most one suspect and its next death is charged to that one alone
ARGV[10] the status channel (fc:status, pub/sub) and ARGV[11] the execution id: "take"
         and a resume to "queue" publish the execution's new list row there (the live
         lists), as start.lua does
ARGV[12] resume, cancel: how long the store is still behind, in ms (store.lua's wait
         after it came back without writes it had acknowledged; "" or "0": it is not):
         a pause is held that long (HELD), whatever it is: it may be one the store
         brought back after a resume it lost, whose owner, stalled, takes the run back
         within a lease (renew.lua)

Suspicion: `deaths` counts every death of an owner while it ran (charged or not), and a
run with two deaths is a suspect wherever it runs next; `crashes` counts the deaths charged
to it (FLOWCAST_MAX_RECOVERIES bounds them); `quarantined` is "1" once a death was
charged to it as its process's suspect: every takeover from then on says "quarantined"
(the new owner ends it failed instead of running it again).

Times are Redis's own (TIME), never a host's, so a replica whose clock is off can
neither end a healthy execution nor keep a dead one.

A claim sent again (its first answer was lost) finds the caller already owning the
execution and answers as the first run did, with the status it replaced; its `reason`
is the stored one (the last takeover's), whatever the mode. A handoff sent again is
refused MOVED: the caller owns the execution no more.

Returns {lastId, base, statusBefore, owner, epoch, recovery, reason, crashes,
cancelRequested, deaths} on success: a new owner numbers its events from base + 1 (base is
above every id the previous owner may have shown live; ids between lastId and base are
recorded as dropped by its first batch). A takeover is a recovery: `recovery` numbers it (the recovered
events stored so far, plus one), `reason` is "handoff" when the owner let go, else
"worker_lost" ("quarantined" once quarantined), `crashes` counts the deaths charged
to it and `deaths` every death. `cancelRequested`
is "1" when a cancel was accepted and the execution did not end yet: a takeover that
finds it ends the execution cancelled without running anything (the owner died before
it wrote the cancel), so the claim itself tells the new owner, with no window between
the claim and a first write that would tell it too late. Error replies:
  "NOEXEC"          no such execution (or it expired)
  "STATUS <status>" the execution is not in a state this transition applies to
  "BLOCK <blockId>" resume names a block the execution is not paused at
  "LEASE"           takeover: the lease has not expired
  "MOVED"           takeover or handoff: the execution has another owner than the one
                    expected
  "NOTDUE"          expire: the deadline has not passed, or the pause is not stored
                    yet (running, with the deadline its pause saved)
  "MODE <mode>"     ARGV[1] names no transition
  "SUSPECT"         takeover: the caller runs a suspect already (ARGV[9]) and this run's
                    owners died twice: left for a process without one
  "REVOKED"         take: the delivery was revoked (given back to the line): dropped
  "HELD <ms>"       resume or cancel of a pause while the store is behind (ARGV[12]),
                    or of one stored again from a process's memory after the store came
                    back empty (finals.py; `held` says until when, while its last id is
                    that pause's): the store may have lost a resume of it whose owner,
                    stalled, takes the run back within a lease; the caller is told to
                    try again in <ms>
A new owner token in `owner` fences the previous owner out of append.lua.
]]

local meta = KEYS[1]
local mode, token = ARGV[1], ARGV[2]
local lease = tonumber(ARGV[3])
local now = now_ms()

if mode == "revoke" then
  -- Before anything else: a start's record may not be written yet (queue.lua "enter"
  -- comes a round trip before start.lua), and its taker must be fenced out all the same.
  local now_status = redis.call("HGET", meta, "status")
  if now_status and now_status ~= "queued" then
    return redis.error_reply("STATUS " .. now_status)
  end
  redis.call("SADD", KEYS[3], token)
  redis.call("PEXPIRE", KEYS[3], lease)
  if now_status then
    return 1
  end
  return 0
end

local state = redis.call("HMGET", meta, "status", "lastId", "owner", "leaseUntil",
  "pauseBlock", "pauseDeadline", "epoch", "reserved", "handoff", "recoveries",
  "recoveryReason", "crashes", "cancelRequested", "deaths", "quarantined")
local status = state[1]
if not status then
  return redis.error_reply("NOEXEC")
end
local last = tonumber(state[2]) or 0
local base = math.max(last, tonumber(state[8]) or 0)

-- A pause is held (HELD) while the store is behind (ARGV[12]), and a pause stored again
-- while it is the last event, until `held`'s time: the longer of the two.
local function held_for()
  if status ~= "paused" then
    return nil
  end
  local behind = tonumber(ARGV[12]) or 0
  local held = redis.call("HGET", meta, "held")
  if held then
    local at, until_ms = string.match(held, "^(%d+) (%d+)$")
    if tonumber(at) == last and tonumber(until_ms) > now then
      behind = math.max(behind, tonumber(until_ms) - now)
    end
  end
  if behind <= 0 then
    return nil
  end
  return behind
end

local recoveries = tonumber(state[10]) or 0
local crashes = tonumber(state[12]) or 0
local cancel = state[13] or "0"
local deaths = tonumber(state[14]) or 0
local quarantined = state[15] == "1"

if state[3] == token and mode ~= "handoff" then
  local before = "paused"
  if mode == "takeover" then
    before = "running"
  elseif mode == "take" then
    before = "queued"
  end
  local recovery = recoveries
  if mode == "takeover" then
    recovery = recoveries + 1
  end
  return {last, base, before, token, tonumber(state[7]) or 0, recovery, state[11] or "",
    crashes, cancel, deaths}
end

local function own(keep_cancel, reason)
  -- The new owner numbers above the durable ceiling too (ARGV[7]), whatever the mode.
  base = math.max(base, tonumber(ARGV[7]) or 0)
  local epoch = (tonumber(state[7]) or 0) + 1
  redis.call("HSET", meta, "owner", token, "epoch", epoch, "leaseUntil", now + lease,
    "status", "running", "pauseBlock", "", "pauseDeadline", "", "reserved", base)
  redis.call("HDEL", meta, "handoff")
  if not keep_cancel then
    redis.call("HDEL", meta, "cancelRequested")
    cancel = "0"
  end
  if reason then
    -- `recoveries` counts the execution:recovered events stored (append.lua); this
    -- one is the next, whether or not an earlier taker lived to store its own. A
    -- crash counts as soon as the execution is claimed after it.
    if reason == "worker_lost" then
      deaths = deaths + 1
      local verdict = ARGV[8] or ""
      if verdict == "" or verdict == "alone" or verdict == "suspect" then
        crashes = crashes + 1
      end
      if verdict == "suspect" then
        quarantined = true
        redis.call("HSET", meta, "quarantined", "1")
      end
    end
    if quarantined then
      reason = "quarantined"
    end
    redis.call("HSET", meta, "recoveryReason", reason, "crashes", crashes, "deaths", deaths)
    return {last, base, status, token, epoch, recoveries + 1, reason, crashes, cancel, deaths}
  end
  return {last, base, status, token, epoch, recoveries, "", crashes, cancel, deaths}
end

if (mode == "resume" or mode == "cancel") and held_for() then
  return redis.error_reply("HELD " .. held_for())
end

if mode == "resume" then
  if status ~= "paused" then
    return redis.error_reply("STATUS " .. status)
  end
  if ARGV[4] ~= "" and ARGV[4] ~= state[5] then
    return redis.error_reply("BLOCK " .. (state[5] or ""))
  end
  if ARGV[6] and ARGV[6] ~= "" and state[5] then
    redis.call("HSET", KEYS[2], "a:" .. state[5], ARGV[6])
  end
  if ARGV[5] == "queue" then
    redis.call("HSET", meta, "status", "queued", "owner", "", "leaseUntil", 0,
      "pauseBlock", "", "pauseDeadline", "", "continues", state[5] or "")
    if ARGV[10] and ARGV[10] ~= "" then
      publish_row(meta, ARGV[10], ARGV[11], "queued", last)
    end
    return {last, base, status, "", tonumber(state[7]) or 0, recoveries, "", crashes,
      cancel, deaths}
  end
  return own(false)
elseif mode == "cancel" then
  if status == "running" then
    redis.call("HSET", meta, "cancelRequested", "1")
    return {last, base, status, state[3], tonumber(state[7]) or 0, recoveries, "", crashes,
      "1", deaths}
  end
  if status ~= "paused" and status ~= "queued" then
    return redis.error_reply("STATUS " .. status)
  end
  local won = own(false)
  -- The caller now writes the cancel. Should it die first, the cancel still holds: a
  -- takeover keeps this flag, so the execution's next owner ends it cancelled too.
  redis.call("HSET", meta, "cancelRequested", "1")
  won[9] = "1"
  return won
elseif mode == "takeover" then
  if status ~= "running" then
    return redis.error_reply("STATUS " .. status)
  end
  local handed = state[9]
  -- A second suspect here would share the blame of this process's next death: left for
  -- a process without one (unless it only ends: quarantined, or its cancel accepted).
  local function suspect_refused(died_now)
    local died = deaths
    if died_now then
      died = died + 1
    end
    -- SUSPECT_DEATHS (blame.py): one death makes no suspect, so the runs of a replica
    -- that died of anything are all taken over at once.
    return ARGV[9] == "busy" and died >= 2 and not quarantined
      and ARGV[8] ~= "suspect" and cancel ~= "1"
  end
  if handed then
    -- Let go by its owner (now ""): it names itself in `handoff`.
    if ARGV[4] ~= "" and ARGV[4] ~= handed then
      return redis.error_reply("MOVED")
    end
    if suspect_refused(false) then
      return redis.error_reply("SUSPECT")
    end
    return own(true, "handoff")
  end
  if ARGV[5] == "handoff" then
    return redis.error_reply("LEASE")
  end
  if ARGV[4] ~= "" and ARGV[4] ~= state[3] then
    return redis.error_reply("MOVED")
  end
  if ARGV[5] == "dead" then
    if ARGV[4] == "" or ARGV[4] ~= state[3] then
      return redis.error_reply("MOVED")
    end
  elseif (tonumber(state[4]) or 0) >= now then
    return redis.error_reply("LEASE")
  end
  if suspect_refused(true) then
    return redis.error_reply("SUSPECT")
  end
  -- A cancel asked of the dead owner still holds: its ending will be the cancel.
  return own(true, "worker_lost")
elseif mode == "handoff" then
  if status ~= "running" then
    return redis.error_reply("STATUS " .. status)
  end
  if state[3] ~= token then
    return redis.error_reply("MOVED")
  end
  -- No owner now: its writer and its renewals are fenced out (append.lua, renew.lua).
  redis.call("HSET", meta, "owner", "", "handoff", token, "leaseUntil", 0)
  -- Ids reserved but shown to nobody named no event: handed back, the next owner
  -- numbers from the last id a client may have seen, and reports no gap for the rest.
  -- Never below what was shown (nor the stored last id), never above the reservation.
  local shown = tonumber(ARGV[4])
  if shown then
    local keep = math.max(last, shown)
    if keep < base then
      redis.call("HSET", meta, "reserved", keep)
      base = keep
    end
  end
  return {last, base, status, "", tonumber(state[7]) or 0, recoveries, "handoff", crashes,
    cancel, deaths}
elseif mode == "expire" then
  local deadline = tonumber(state[6])
  if status == "running" and deadline then
    -- Its pause saved the deadline but is not stored yet (a slow write): still due
    -- once it is, so the janitors keep watching it.
    return redis.error_reply("NOTDUE")
  end
  if status ~= "paused" then
    return redis.error_reply("STATUS " .. status)
  end
  if not deadline or deadline > now then
    return redis.error_reply("NOTDUE")
  end
  return own(false)
elseif mode == "take" then
  if status ~= "queued" then
    return redis.error_reply("STATUS " .. status)
  end
  if redis.call("SISMEMBER", KEYS[3], token) == 1 then
    return redis.error_reply("REVOKED")
  end
  local continues = redis.call("HGET", meta, "continues")
  local won = own(false)
  redis.call("HDEL", meta, "continues")
  if (not continues or continues == "") and base == 0 then
    -- A start: the ids ARGV[4] reserves for the taker's first events (the dispatcher
    -- reserves none: dispatch.py says why); above a durable ceiling (a store back
    -- behind), it numbers from there instead.
    redis.call("HSET", meta, "reserved", tonumber(ARGV[4]) or 0)
  end
  if ARGV[10] and ARGV[10] ~= "" then
    publish_row(meta, ARGV[10], ARGV[11], "running", last)
  end
  return won
end
return redis.error_reply("MODE " .. mode)
