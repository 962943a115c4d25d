"""The Lua scripts of the Redis backend that write history apart from a lease's end:
pruning it, a record added by the client, a success kept for ``once`` and its forgetting.
Stored form: see :mod:`celery_dlock.backends.redis.scripts`."""

from __future__ import annotations

from celery_dlock.backends.redis.scripts import Script

__all__ = ["ADD", "FIND", "FORGET", "PRUNE", "REMEMBER"]

PRUNE = Script(
    "prune",
    """
-- prune: KEYS 1 history | ARGV 1 before (seconds), 2 first and 3 last ms to look at one
-- by one | how many records released before went
local before = tonumber(ARGV[1])
local gone = redis.call('XTRIM', KEYS[1], 'MINID', '=', ARGV[2])
-- Entry ids are release times, but add_record's may be a millisecond off: near the cut,
-- decide by each record's own release time.
local near = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[3] .. '-18446744073709551615')
for _, entry in ipairs(near) do
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == 'rel' and tonumber(f[i + 1]) < before then
      gone = gone + redis.call('XDEL', KEYS[1], entry[1])
    end
  end
end
return gone
""",
)

ADD = Script(
    "add",
    """
-- add: KEYS 1 history[, 2 result key: kept there unless another lease's is] | ARGV 1
-- maxlen, 2 id ms, 3 result ms, 4... the record's fields (7: its token) | 1
local fields = {}
for i = 4, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
local added = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], ARGV[2] .. '-*', unpack(fields))
if type(added) == 'table' and added.err then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(fields))
end
local kept = KEYS[2] and redis.call('HGET', KEYS[2], 'tok')
if KEYS[2] and (not kept or kept == ARGV[7]) then
  redis.call('HSET', KEYS[2], unpack(fields))
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
""",
)

REMEMBER = Script(
    "remember",
    """
-- remember: KEYS 1 result key | ARGV 1 result ms, 2... the record's fields | 1 kept,
-- 0 when another lease's success is kept (first wins; the lease's own, by token, is
-- updated)
local fields, token = {}, nil
for i = 2, #ARGV do
  fields[#fields + 1] = ARGV[i]
  if ARGV[i] == 'tok' and i % 2 == 0 then
    token = ARGV[i + 1]
  end
end
local kept = redis.call('HGET', KEYS[1], 'tok')
if kept and kept ~= token then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
""",
)

FORGET = Script(
    "forget",
    """
-- forget: KEYS 1 result key, 2 its forget mark | ARGV 1 the token of the lease that kept
-- it, 2 this call's nonce, 3 the mark's life (ms) | 1 if that lease's success was kept and
-- this call forgot it (a run again after a lost reply finds its own nonce), else 0
if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] then
  if redis.call('GET', KEYS[2]) == ARGV[2] then
    return 1
  end
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return redis.call('DEL', KEYS[1])
""",
)

FIND = Script(
    "find",
    """
-- find: KEYS 1 history | ARGV 1 newest id (exclusive: '(' id) or '+', 2 oldest id or '-',
-- 3 entries to look at, 4 key or '', 5 outcome or '' | the id of the last entry looked
-- at ('' when none is left), then the entries of that key and outcome, newest first.
-- Filtered here: a rare key's records come back without the rest of the stream.
local entries = redis.call('XREVRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])
local found = {''}
if #entries == tonumber(ARGV[3]) then
  found[1] = entries[#entries][1]
end
for _, entry in ipairs(entries) do
  local f = entry[2]
  local ok = true
  for i = 1, #f, 2 do
    if (f[i] == 'key' and ARGV[4] ~= '' and f[i + 1] ~= ARGV[4])
        or (f[i] == 'out' and ARGV[5] ~= '' and f[i + 1] ~= ARGV[5]) then
      ok = false
      break
    end
  end
  if ok then
    found[#found + 1] = entry
  end
end
return found
""",
)
