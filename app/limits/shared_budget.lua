-- One OpenAI key's budget for every replica: a token bucket per model, leased out in grants.
-- Atomic by construction (Redis runs a script alone); its clock is Redis's own TIME, so
-- replicas' clocks never have to agree. See shared_budget.py for the design.
--
-- KEYS: 1 state hash, 2 holders hash (holder -> its last call), 3 active hash (holder -> its
--       last call with a need), 4 pause channel
-- ARGV: 1 holder, 2 rpm, 3 tpm, 4 burst fraction, 5 need requests, 6 need tokens,
--       7 want requests, 8 want tokens, 9 returned requests, 10 returned tokens,
--       11 pause seconds, 12 observed rpm, 13 observed tpm, 14 remaining requests,
--       15 remaining tokens, 16 lease seconds, 17 horizon seconds, 18 leaving (1: the holder
--       exits and no longer counts)
-- Returns (as strings): granted requests, granted tokens, seconds until the grant may be
-- used (or, when nothing was granted, until asking again is worth it), live holders, the
-- key's rpm, tpm, seconds of pause left, holders with demand (active).

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local holder = ARGV[1]
local rpm, tpm, fraction = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local need_req, need_tok = tonumber(ARGV[5]), tonumber(ARGV[6])
local want_req, want_tok = tonumber(ARGV[7]), tonumber(ARGV[8])
local ret_req, ret_tok = tonumber(ARGV[9]), tonumber(ARGV[10])
local pause_s = tonumber(ARGV[11])
local obs_rpm, obs_tpm = tonumber(ARGV[12]), tonumber(ARGV[13])
local rem_req, rem_tok = tonumber(ARGV[14]), tonumber(ARGV[15])
local lease_s, horizon_s, leaving = tonumber(ARGV[16]), tonumber(ARGV[17]), ARGV[18] == '1' 
local OBSERVED_FOR_S = 60 -- a reported limit holds this long unless reported again
local KEEP_MS = 600000 -- idle state disappears after ten minutes

local s = redis.call('HMGET', KEYS[1], 'req', 'tok', 'ts', 'paused', 'obs_rpm', 'obs_tpm', 'obs_until')

-- The limits in force: configured, lowered by what any replica last saw reported.
local o_rpm, o_tpm, o_until = tonumber(s[5]) or 0, tonumber(s[6]) or 0, tonumber(s[7]) or 0
if obs_rpm > 0 then o_rpm = obs_rpm; o_until = now + OBSERVED_FOR_S end
if obs_tpm > 0 then o_tpm = obs_tpm; o_until = now + OBSERVED_FOR_S end
if o_until > now then
  if o_rpm > 0 and o_rpm < rpm then rpm = o_rpm end
  if o_tpm > 0 and o_tpm < tpm then tpm = o_tpm end
end
local rate_req, rate_tok = rpm / 60, tpm / 60
local cap_req, cap_tok = math.max(1, rpm * fraction), math.max(1, tpm * fraction)

-- Refill since the last call, take back what a holder returns, adopt a lower remaining.
local req, tok, ts = tonumber(s[1]), tonumber(s[2]), tonumber(s[3])
if req == nil then req, tok, ts = cap_req, cap_tok, now end
local dt = math.max(0, now - ts)
req = math.min(cap_req, req + rate_req * dt + ret_req)
tok = math.min(cap_tok, tok + rate_tok * dt + ret_tok)
if rem_req >= 0 and rem_req < req then req = rem_req end
if rem_tok >= 0 and rem_tok < tok then tok = rem_tok end

-- A 429 seen anywhere pauses everyone: stored for the next callers, published for the rest.
local paused = tonumber(s[4]) or 0
if pause_s > 0 and now + pause_s > paused then
  paused = now + pause_s
  redis.call('PUBLISH', KEYS[4], tostring(pause_s))
end

-- Holders heard from within three leases are alive, those that asked with a need in that
-- time active: the counts size each one's share (of the fallback, of the predictions).
local needs = need_req > 0 or need_tok > 0
if leaving then
  redis.call('HDEL', KEYS[2], holder)
  redis.call('HDEL', KEYS[3], holder)
else
  redis.call('HSET', KEYS[2], holder, tostring(now))
  if needs then redis.call('HSET', KEYS[3], holder, tostring(now)) end
end
local function count_recent(key)
  local n, seen = 0, redis.call('HGETALL', key)
  for i = 1, #seen, 2 do
    if now - tonumber(seen[i + 1]) > 3 * lease_s then
      redis.call('HDEL', key, seen[i])
    else
      n = n + 1
    end
  end
  return n
end
local live, active = count_recent(KEYS[2]), count_recent(KEYS[3])

-- Seconds until the bucket holds the need (an oversize need: a full bucket, then it
-- takes all it asked for, leaving a debt), and not before a pause ends.
local function fit_time(tokens, requests)
  local t_req = (requests - req) / rate_req
  local t_tok = (math.min(tokens, cap_tok) - tok) / rate_tok
  local wait = math.max(0, t_req, t_tok)
  if paused > now then wait = math.max(wait, paused - now) end
  return wait
end

-- A need is granted at once, even when the bucket cannot pay it yet: the bucket goes
-- into debt and the holder waits out the returned seconds before using the grant. Each
-- later need sees the debt and waits longer, so holders are served in the order they
-- asked (a big need is never starved by small ones) in one round trip each. A need is
-- granted when the debt ahead of it is within the horizon (its own refill time does not
-- count against it: a need bigger than a horizon's refill would never be granted);
-- otherwise it asks again later.
local granted_req, granted_tok, wait = 0, 0, 0
if needs then
  wait = fit_time(need_tok, need_req)
  local own = math.max(need_req / rate_req, math.min(need_tok, cap_tok) / rate_tok)
  if wait <= horizon_s + own then
    local extra = (wait <= 1e-9)
    granted_req = extra and math.max(need_req, math.min(want_req, req)) or need_req
    granted_tok = extra and math.max(need_tok, math.min(want_tok, tok)) or need_tok
  end
elseif paused <= now and req > 0 and tok > 0 then
  granted_req = math.max(0, math.min(want_req, req))
  granted_tok = math.max(0, math.min(want_tok, tok))
end
req = req - granted_req
tok = tok - granted_tok

redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'ts', tostring(now),
  'paused', tostring(paused), 'obs_rpm', tostring(o_rpm), 'obs_tpm', tostring(o_tpm),
  'obs_until', tostring(o_until))
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], KEEP_MS) end
return {tostring(granted_req), tostring(granted_tok), tostring(wait), tostring(live),
  tostring(rpm), tostring(tpm), tostring(math.max(0, paused - now)), tostring(active)}
