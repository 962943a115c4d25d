"""The Lua scripts of the Redis backend: every change to a lock is one of these, atomic.

Conventions shared by the scripts that can end a lease (so ``end_lease`` needs no
arguments for them):

- ``KEYS``: 1 lock, 2 state, 3 index, 4 history, 5 signal, then the script's own keys.
- ``ARGV``: 1 history maxlen, 2 state retention in ms once the key is free, 3 signal
  retention in ms, then the script's own arguments.

Stored form (:mod:`celery_dlock.backends.redis.fields` reads it back):

- ``lock``: a string holding the token, expiring by Redis's clock (``PXAT``), or not at all.
- ``state``: a hash ``fence, tok, holder, acq, exp`` for the lease, kept until the lease is
  recorded, so a lease that Redis expired can still be recorded; ``tok`` is empty once it
  is (the other fields then linger until the next lease). ``rtok, rel, rexp`` name the
  last release: a retried release finds its first attempt there. ``wt`` is the time (ms)
  until which a waiter may be blocked on the signal list: releases wake only then. The
  hash expires the retention after the lease's expiry (or after its release, for a lease
  without expiry). A fence is Redis's clock in microseconds (or the last fence + 1, if
  higher), so it rises across a lost state, a restart and a failover alike.
- ``index``: a sorted set of keys with a lease, scored by expiry in ms (``+inf``: none).
- ``history``: a stream of records, fields ``key tok fence holder acq exp rel out prob det
  res``; ``prob det res`` are JSON texts. Entry ids are the release time in ms.
- ``signal``: a list that holds one wake-up for a waiter for a short while after a release.

Replies are one space-separated string where a script returns several values (``-`` for
no expiry): one bulk string parses faster than an array, in redis-py and here.

Times (``acq``, ``exp``, ``rel``) are stored as decimal seconds since the epoch,
``1795283662.263032``: from Redis's clock (``TIME``) in the scripts, from the caller's
float (its ``repr``) in ``add_record``; either reads back as the very same float.
Scripts compute with integer microseconds and milliseconds, and numbers leave Lua only
through ``string.format``: Lua 5.1 prints numbers with 14 digits, fences have 16.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from celery_dlock.backends.redis.resp import bulks

__all__ = [
    "ACQUIRE",
    "DUE",
    "EXPIRE",
    "PEEK",
    "PROBE",
    "RELEASE",
    "RENEW",
    "Script",
]


@dataclass(frozen=True)
class Script:
    """A Lua script, its SHA-1 (the name ``EVALSHA`` knows it by), and the first two parts
    of the command that runs it, packed: ``EVALSHA sha`` and, after a ``NOSCRIPT``,
    ``EVAL source``. ``simple``: its reply is one bulk string or integer, read by
    ``resp.call_simple``."""

    name: str
    source: str
    simple: bool = False
    sha: str = field(init=False)
    by_sha: bytes = field(init=False, repr=False)
    by_source: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sha = hashlib.sha1(self.source.encode()).hexdigest()
        object.__setattr__(self, "sha", sha)
        object.__setattr__(self, "by_sha", bulks(["EVALSHA", sha]))
        object.__setattr__(self, "by_source", bulks(["EVAL", self.source]))


_PRELUDE = """
local function int(n)
  return string.format('%d', n)
end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- keep_state: the lease's expiry in ms or nil | the state hash kept the retention past it
local function keep_state(exp_ms)
  if exp_ms then
    redis.call('PEXPIREAT', KEYS[2], int(exp_ms + tonumber(ARGV[2])))
  else
    redis.call('PERSIST', KEYS[2])
  end
end

-- seconds: microseconds | decimal seconds
local function seconds(us)
  return string.format('%d.%06d', math.floor(us / 1000000), us % 1000000)
end

-- ms_seconds: milliseconds | decimal seconds
local function ms_seconds(ms)
  return string.format('%d.%03d', math.floor(ms / 1000), ms % 1000)
end

-- wake: KEYS[5] signal | one wake-up left in the signal list for the first waiter
local function wake()
  if redis.call('LPUSH', KEYS[5], '1') > 1 then
    redis.call('LTRIM', KEYS[5], 0, 0)
  end
  redis.call('PEXPIRE', KEYS[5], ARGV[3])
end

-- live: a state's token field | whether it names a lease not yet recorded
local function live(token)
  return token and token ~= ''
end

-- end_lease: the lease in KEYS[2], key, outcome, JSON of problem/details/result, release
-- time, wake?, result key or nil (kept there unless another lease's is), its retention,
-- the token of a release to remember or nil, the state as read by STATE or nil | the
-- record's fields, now in history
local STATE = {'tok', 'fence', 'holder', 'acq', 'exp', 'wt'}
local function end_lease(key, outcome, prob, det, res, rel, waking, result_key, result_ms, token, s)
  s = s or redis.call('HMGET', KEYS[2], unpack(STATE))
  local fields = {'key', key, 'tok', s[1], 'fence', s[2], 'holder', s[3], 'acq', s[4],
                  'exp', s[5], 'rel', seconds(rel), 'out', outcome, 'prob', prob, 'det', det,
                  'res', res}
  local id = int(math.floor(rel / 1000)) .. '-*'
  local added = redis.pcall('XADD', KEYS[4], 'MAXLEN', '~', ARGV[1], id, unpack(fields))
  if type(added) == 'table' and added.err then
    -- Redis's clock went back below the newest entry: keep stream order, take its id.
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[1], '*', unpack(fields))
  end
  -- The first success wins: another lease's stays; this lease's own is updated.
  local kept = result_key and redis.call('HGET', result_key, 'tok')
  if result_key and (not kept or kept == s[1]) then
    redis.call('HSET', result_key, unpack(fields))
    redis.call('PEXPIRE', result_key, result_ms)
  end
  if token then
    redis.call('HSET', KEYS[2], 'tok', '', 'rtok', token, 'rel', fields[14], 'rexp', s[5])
  else
    redis.call('HSET', KEYS[2], 'tok', '')
  end
  if s[5] == '' then
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
  end
  redis.call('ZREM', KEYS[3], key)
  if waking and s[6] and tonumber(s[6]) * 1000 > rel then
    wake()
  end
  return fields
end
"""


def _script(name: str, body: str, simple: bool = False) -> Script:
    """A script that may end a lease: its header comment, then the shared functions."""
    lines = body.lstrip("\n").split("\n")
    header = 0
    while lines[header].startswith("--"):
        header += 1
    source = "\n".join([*lines[:header], _PRELUDE.strip("\n"), *lines[header:]])
    return Script(name, source, simple)


ACQUIRE = _script(
    "acquire",
    """
-- acquire: KEYS +6 epoch, 7 quarantine, 8 server | ARGV +4 key, token, ttl ms or '',
-- holder JSON, epoch this client saw or '', quarantine ms (0: none), token of a live
-- lease to take over or '', details JSON for its record, tokens of this acquire's
-- earlier tries (space-separated; '' on its first) | 'fence acq exp epoch' taken as
-- token; 'fence acq exp - earlier' an earlier try took it and its reply was lost;
-- '0 epoch' held by another, or quarantined ('-': the epoch was not read); ' expired'
-- ends the reply of a grant that recorded the lease before it expired
-- restarted: the bucket's server key (the LASTSAVE and run_id last seen) or nil, now, the
-- quarantine ms | whether this Redis is another process than the one that granted the
-- bucket's last leases, started or promoted within the quarantine (a restart, even one
-- that kept its data in a snapshot or an AOF, or a failover); the quarantine then begun.
-- Leases granted after the last write that reached the disk, or the replica, are gone
-- while their holders may still run. LASTSAVE changes at each save and at a start, so
-- INFO (about 13 us) is read only when it did; a LASTSAVE of the current second is
-- stored as 0: a process started within that second would have the same.
local function restarted(seen, now, quiet)
  local saved = redis.call('LASTSAVE')
  local same = saved .. ' '  -- the usual case, told by the prefix (a third of a match)
  if seen and string.sub(seen, 1, #same) == same then
    return false
  end
  local run = string.match(seen or '', '^%d+ (%x+)$')
  local info = redis.call('INFO', 'server')
  local current = string.match(info, 'run_id:(%x+)')
  local stamp = saved
  if saved >= math.floor(now / 1000000) then
    stamp = 0
  end
  redis.call('SET', KEYS[8], stamp .. ' ' .. current)
  if run == current then
    return false
  end
  -- Another process: the loss came at its start, and holders of lost leases noticed at
  -- their next renewal if that was a quarantine ago. A replica promoted (it keeps its
  -- former primary's replication id as its second) lost them now, whatever its age.
  local left = quiet - 1000 * tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
  local replication = run and redis.call('INFO', 'replication') or ''
  if string.match(replication, 'second_repl_offset:(%d+)') then
    left = quiet
  end
  -- Never noted (a new bucket, or noted after the last write that reached the disk) and
  -- the epoch gone too: the loss of every key, which the epoch's check below sees.
  if left <= 0 or (not run and not redis.call('GET', KEYS[6])) then
    return false
  end
  redis.call('SET', KEYS[7], int(now), 'PX', int(left))
  return true
end

local key, token, ttl, replace = ARGV[4], ARGV[5], ARGV[6], ARGV[10]
if ARGV[12] ~= '' then
  -- A retry: each try has a token of its own, so a lease an earlier try took and Redis
  -- expired (recorded under that token) is never granted again under it.
  local current = redis.call('GET', KEYS[1])
  for earlier in string.gmatch(ARGV[12], '%S+') do
    if current == earlier then
      local kept = redis.call('HMGET', KEYS[2], 'fence', 'acq', 'exp')
      if kept[3] == '' then
        kept[3] = '-'
      end
      return table.concat({kept[1], kept[2], kept[3], '-', earlier}, ' ')
    end
  end
end
local now = now_us()
local quiet = tonumber(ARGV[9])
-- q: quarantine, server note, epoch, read once (restarted() writes none that matters here
-- unless it refuses): the early check's, or the stateless branch's below.
local q
if quiet > 0 then
  -- Refused with the epoch: a client that saw an older one learns it while quarantined,
  -- and does not start the quarantine again when it ends (the check below).
  q = redis.call('MGET', KEYS[7], KEYS[8], KEYS[6])
  if q[1] or restarted(q[2], now, quiet) then
    return '0 ' .. (q[3] or '-')
  end
end
local s = redis.call('HMGET', KEYS[2], 'fence', 'tok')
local epoch = '-'
if not s[1] or ARGV[8] == '' then
  -- A key without state: new, idle past the retention, or lost with all of Redis's data.
  -- Only then can the epoch be gone, and every key is without state after such a loss.
  q = q or redis.call('MGET', KEYS[7], KEYS[8], KEYS[6])
  epoch = q[3]
  if not epoch then
    -- No epoch: first use, or Redis lost its data (restart without persistence, failover
    -- to an empty replica, FLUSHDB). Locks held then are gone while their holders may
    -- still run, so nobody gets one for a while. A client that saw the old epoch knows
    -- it was a loss; one that never saw any cannot tell, so it waits out what is left of
    -- the quarantine since the server started (a restart is the usual loss).
    epoch = int(now)
    redis.call('SET', KEYS[6], epoch)
    if ARGV[8] == '' and quiet > 0 then
      local info = redis.call('INFO', 'server')
      quiet = quiet - 1000 * tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
    end
    if quiet > 0 then
      redis.call('SET', KEYS[7], epoch, 'PX', quiet)
      return '0 ' .. epoch
    end
  elseif q[1] then
    -- Another client's quarantine, met only with restart_delay 0 (the early check
    -- refused it otherwise): a new key waits it out all the same.
    return '0 ' .. epoch
  elseif ARGV[8] ~= '' and ARGV[8] ~= epoch and quiet > 0 then
    -- This client saw an older epoch: the data was lost and the loss first met by a client
    -- that could not know it. Stop granting locks for the quarantine from now on.
    redis.call('SET', KEYS[7], epoch, 'PX', ARGV[9])
    return '0 ' .. epoch
  end
end
local exp_ms, exp = nil, ''
local taken
if ttl == '' then
  taken = redis.call('SET', KEYS[1], token, 'NX')
else
  exp_ms = int(math.floor(now / 1000) + tonumber(ttl))
  exp = ms_seconds(exp_ms)
  taken = redis.call('SET', KEYS[1], token, 'NX', 'PXAT', exp_ms)
end
if not taken then
  if replace == '' or redis.call('GET', KEYS[1]) ~= replace then
    return '0 ' .. epoch
  end
  -- A task's retry continues its own attempt: that lease ends 'retried'.
  end_lease(key, 'retried', 'null', ARGV[11], 'null', now, false, nil, nil, nil, nil)
  s[2] = nil
  if exp_ms then
    redis.call('SET', KEYS[1], token, 'PXAT', exp_ms)
  else
    redis.call('SET', KEYS[1], token)
  end
end
local ended = ''
if live(s[2]) then
  -- The lock key was gone but its lease was never recorded: Redis expired it.
  end_lease(key, 'expired', '"expired"', 'null', 'null', now, false, nil, nil, nil, nil)
  ended = ' expired'
end
-- A fence is Redis's clock in microseconds, or one more than the key's last fence if that
-- is higher (the clock stepped back): each acquisition takes Redis more than a
-- microsecond, so fences rise. A key with no state (new, idle past the retention, lost
-- with Redis's data) and a replica promoted without the last grants of its primary (its
-- counter behind) still give a fence above every one given before, as long as the nodes'
-- clocks differ by less than the time a failover takes (seconds).
local fence = now
if s[1] then
  fence = math.max(tonumber(s[1]) + 1, now)
end
fence = int(fence)
local acq = seconds(now)
redis.call('HSET', KEYS[2], 'fence', fence, 'tok', token, 'holder', ARGV[7], 'acq', acq,
           'exp', exp)
keep_state(exp_ms)
redis.call('ZADD', KEYS[3], exp_ms or '+inf', key)
if exp == '' then
  exp = '-'
end
return fence .. ' ' .. acq .. ' ' .. exp .. ' ' .. epoch .. ended
""",
    simple=True,
)

RELEASE = _script(
    "release",
    """
-- release: KEYS +6 result key (only for a success with a result and a task name)
-- | ARGV +4 key, token, outcome, problem JSON, details JSON, result JSON, retry flag,
-- result ms | 'rel exp' released (also when a retry finds its first attempt did it, in the
-- state or, the key taken since, among the newest records); 0 not ours (if it was ours
-- until Redis expired it, that is recorded now)
local key, token = ARGV[4], ARGV[5]
local RECENT = 500  -- records a retry reads back
-- While the lock key exists it holds the state's token: only these scripts write either.
local s = redis.call('HMGET', KEYS[2], unpack(STATE))
if s[1] ~= token then
  local last = ARGV[10] == '1' and redis.call('HMGET', KEYS[2], 'rtok', 'rel', 'rexp')
  if last and last[1] == token then
    if last[3] == '' then
      last[3] = '-'
    end
    return last[2] .. ' ' .. last[3]
  elseif last then
    -- The key changed hands since the first try: its record, if it landed, is in history.
    for _, entry in ipairs(redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', RECENT)) do
      local f = entry[2]
      if f[4] == token and f[16] == ARGV[6] then
        if f[12] == '' then
          f[12] = '-'
        end
        return f[14] .. ' ' .. f[12]
      end
    end
  end
  return 0
end
if redis.call('DEL', KEYS[1]) == 0 then
  end_lease(key, 'expired', '"expired"', 'null', 'null', now_us(), true, nil, nil, nil, s)
  return 0
end
local f = end_lease(key, ARGV[6], ARGV[7], ARGV[8], ARGV[9], now_us(), true, KEYS[6], ARGV[11],
                   token, s)
if f[12] == '' then
  return f[14] .. ' -'
end
return f[14] .. ' ' .. f[12]
""",
    simple=True,
)

RENEW = _script(
    "renew",
    """
-- renew: ARGV +4 key, token, ttl ms or '', '1': a hand_over (never shorter), the expiry
-- seen in ms (or '-': none) for a hand_over only while it is still that one, or ''
-- | 'exp' or 0
local key, token, ttl, seen = ARGV[4], ARGV[5], ARGV[6], ARGV[8]
if redis.call('GET', KEYS[1]) ~= token then
  -- Never revive a lock Redis expired (nor send PEXPIRE 0, which deletes): record it.
  if redis.call('HGET', KEYS[2], 'tok') == token then
    end_lease(key, 'expired', '"expired"', 'null', 'null', now_us(), true, nil, nil, nil, nil)
  end
  return 0
end
if ARGV[7] == '1' and redis.call('PTTL', KEYS[1]) > tonumber(ttl) then
  return redis.call('HGET', KEYS[2], 'exp')
end
if seen ~= nil and seen ~= '' then
  local exp = redis.call('HGET', KEYS[2], 'exp')
  -- Renewed or handed over since it was seen: its expiry stands.
  if exp and exp ~= '' and (seen == '-' or math.floor(exp * 1000 + 0.5) ~= tonumber(seen)) then
    return exp
  end
end
local exp = ''
local exp_ms = nil
if ttl == '' then
  redis.call('PERSIST', KEYS[1])
  redis.call('ZADD', KEYS[3], '+inf', key)
else
  exp_ms = math.floor(now_us() / 1000) + tonumber(ttl)
  exp = ms_seconds(exp_ms)
  redis.call('PEXPIREAT', KEYS[1], int(exp_ms))
  redis.call('ZADD', KEYS[3], int(exp_ms), key)
end
redis.call('HSET', KEYS[2], 'exp', exp)
keep_state(exp_ms)
if exp == '' then
  return '-'
end
return exp
""",
    simple=True,
)

EXPIRE = _script(
    "expire",
    """
-- expire: ARGV +4 key | the record's fields if the key's lease had expired unrecorded
-- (now recorded 'expired'), else {} (alive, or already recorded by someone else)
local key = ARGV[4]
local token = redis.call('HGET', KEYS[2], 'tok')
if not live(token) then
  redis.call('ZREM', KEYS[3], key)
  return {}
end
if redis.call('GET', KEYS[1]) == token then
  return {}
end
return end_lease(key, 'expired', '"expired"', 'null', 'null', now_us(), true, nil, nil, nil, nil)
""",
)

PEEK = Script(
    "peek",
    """
-- peek: KEYS 1 lock, 2 state | {tok, fence, holder, acq, exp} of the live lease, or {}
local token = redis.call('GET', KEYS[1])
if not token then
  return {}
end
local s = redis.call('HMGET', KEYS[2], 'tok', 'fence', 'holder', 'acq', 'exp')
if s[1] ~= token then
  return {}
end
return s
""",
)

PROBE = Script(
    "probe",
    """
-- probe: KEYS 1 lock, 2 quarantine, 3 state | ARGV 1 ms a waiter may block | ms until the
-- key may be free: -2 free now, -1 held with no expiry. A held key's state notes that a
-- waiter is coming, so that its release pushes a wake-up.
local left = redis.call('PTTL', KEYS[1])
if left == -2 then
  local quarantine = redis.call('PTTL', KEYS[2])
  if quarantine > 0 then
    return quarantine
  end
  return left
end
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
redis.call('HSET', KEYS[3], 'wt', string.format('%d', until_ms))
return left
""",
)

DUE = Script(
    "due",
    """
-- due: KEYS 1 index | ARGV 1 limit | keys whose lease expired by Redis's clock, oldest first
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now_ms),
                  'LIMIT', 0, ARGV[1])
""",
)
