"""Lua for `RedisClusterIndex`: each script touches the keys of ONE shard, so of one cluster slot.

A shard's keys share the hash tag T = "{<prefix>s<shard>}" (see redis_cluster.py for the layout):
  T instances   set of the shard's instance names
  T clock       counter the LRU scores come from (order within the shard)
  T evictions   counter of entries dropped to stay under the cap
  T i:<inst>    hash {8-byte block key: "<tier bits>" | "u<expiry ms>"} plus one "~" marker field
  T l:<inst>    sorted set {8-byte block key: last touch}: the instance's LRU order
Keys built inside a script (T i:<inst> of another instance in the look-up) carry the same tag, so
Redis Cluster accepts them (a script may use undeclared keys of the slot it was routed to).

Values and the look-up's walk over them are RedisIndex's; the look-up adds probes (below).
"""

from __future__ import annotations

from adapters.index.redis import _NOW_MS, WALK_CHUNK

# KEYS[1] instances, KEYS[2] clock, KEYS[3] evictions, KEYS[4] T i:<inst>, KEYS[5] T l:<inst>.
# ARGV: instance, unconfirmed ttl ms, key ttl ms, max_blocks, instances in other shards, use HPEXPIRE
# (server 7.4+), the packed keys of all writes, then per write (base.Write, in order): kind, tier
# bits, key count. An instance lives in one shard, so a whole event batch (or one insert / remove /
# drop) is this one script on one node. Returns {instances in this shard, entries evicted}.
APPLY = (
    _NOW_MS
    + """
local inst, unconf_ms, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local max_blocks, others, hexpire, blob = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1', ARGV[7]
local hk, lk = KEYS[4], KEYS[5]
local guess = 'u' .. (now + unconf_ms)

-- n keys from byte offset `at` of the blob, in tier bit tbit (confirmed) or as dispatch guesses
local function insert(at, n, tbit, confirmed)
  local base = redis.call('INCRBY', KEYS[2], n) - n
  redis.call('SADD', KEYS[1], inst)
  if redis.call('EXISTS', hk) == 0 then
    -- a long marker value forces the hashtable encoding (a listpack makes every HMGET field a scan)
    redis.call('HSET', hk, '~', string.rep('-', 65))
  end
  for lo = 0, n - 1, 1000 do
    local hi = math.min(n, lo + 1000) - 1
    local fields = {}
    for i = lo, hi do fields[#fields + 1] = string.sub(blob, at + i * 8 + 1, at + i * 8 + 8) end
    local old = redis.call('HMGET', hk, unpack(fields))
    local sets, touch, guessed, kept = {}, {}, {}, {}
    for j = 1, #fields do
      local v, f = old[j], fields[j]
      if confirmed then
        local b = 0
        if v and string.byte(v, 1) ~= 117 then b = tonumber(v) elseif v then kept[#kept + 1] = f end
        sets[#sets + 1] = f
        sets[#sets + 1] = tostring(bit.bor(b, tbit))
      elseif not v or string.byte(v, 1) == 117 then
        sets[#sets + 1] = f
        sets[#sets + 1] = guess
        guessed[#guessed + 1] = f
      end
      -- the head of a prompt gets the newest score, so eviction eats chains from their tails
      touch[#touch + 1] = base + n - (lo + j - 1)
      touch[#touch + 1] = f
    end
    if #sets > 0 then redis.call('HSET', hk, unpack(sets)) end
    if hexpire then
      -- per-field TTL frees a guess's memory on time; the value's expiry stays the truth for look-ups
      if #guessed > 0 then redis.call('HPEXPIRE', hk, unconf_ms, 'FIELDS', #guessed, unpack(guessed)) end
      if #kept > 0 then redis.call('HPERSIST', hk, 'FIELDS', #kept, unpack(kept)) end
    end
    redis.call('ZADD', lk, unpack(touch))
  end
  redis.call('PEXPIRE', hk, ttl_ms)
  redis.call('PEXPIRE', lk, ttl_ms)
  local members = redis.call('SCARD', KEYS[1])
  -- fair share: an instance keeps at most max_blocks / (instances known), so the shards need no
  -- shared counter and the total stays under max_blocks (see the module docstring for the bound);
  -- checked after every insert, as separate calls would have it
  local cap = math.max(1, math.floor(max_blocks / (others + members)))
  local excess = redis.call('ZCARD', lk) - cap
  if excess <= 0 then return 0 end
  local victims = redis.call('ZPOPMIN', lk, excess)
  for lo = 1, #victims, 2000 do
    local gone = {}
    for i = lo, math.min(#victims, lo + 1999), 2 do gone[#gone + 1] = victims[i] end
    redis.call('HDEL', hk, unpack(gone))
  end
  redis.call('INCRBY', KEYS[3], excess)
  return excess
end

-- n keys from byte offset `at`, forgotten in the tiers of `mask` (a guess goes whatever the mask)
local function remove(at, n, mask)
  for off = at + 1, at + n * 8, 8 do
    local f = string.sub(blob, off, off + 7)
    local v = redis.call('HGET', hk, f)
    if v then
      local b = 0
      if string.byte(v, 1) ~= 117 then b = bit.band(tonumber(v), bit.bnot(mask)) end
      if b == 0 then
        redis.call('HDEL', hk, f)
        redis.call('ZREM', lk, f)
      else
        redis.call('HSET', hk, f, tostring(b))
      end
    end
  end
end

local evicted, at = 0, 0
for w = 8, #ARGV, 3 do
  local kind, bits, n = tonumber(ARGV[w]), tonumber(ARGV[w + 1]), tonumber(ARGV[w + 2])
  if kind <= 1 then
    evicted = evicted + insert(at, n, bits, kind == 0)
  elseif kind == 2 then
    remove(at, n, bits)
  else
    redis.call('UNLINK', hk, lk)
    redis.call('SREM', KEYS[1], inst)
  end
  at = at + n * 8
end
return {redis.call('SCARD', KEYS[1]), evicted}
"""
)

# KEYS[1] instances, KEYS[2] evictions. ARGV: tag. Returns {evictions, entries, instance names...}.
STATS = """
local tag = ARGV[1]
local names = redis.call('SMEMBERS', KEYS[1])
local entries = 0
for _, inst in ipairs(names) do entries = entries + redis.call('ZCARD', tag .. 'l:' .. inst) end
local out = {tonumber(redis.call('GET', KEYS[2]) or '0'), entries}
for _, inst in ipairs(names) do out[#out + 1] = inst end
return out
"""

# KEYS[1] instances, KEYS[2] clock, KEYS[3] evictions. ARGV: tag. Returns the keys deleted.
CLEAR = """
local tag = ARGV[1]
local deleted = 0
for _, inst in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  deleted = deleted + redis.call('UNLINK', tag .. 'i:' .. inst, tag .. 'l:' .. inst)
end
return deleted + redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3])
"""

# KEYS[1] the first listed shard's instances set (it routes the call). ARGV: packed keys, then the
# tags of the shards to answer for: every shard a node serves, in ONE call per node (a per-node round
# trip instead of one script per shard, and the 8-byte-per-block blob sent once per node). Old-style
# EVAL scripts may already touch other slots of their node; the shebang says so explicitly, and
# no-writes lets a replica answer. A shard whose slot this node does not serve (a stale slot map in
# the client, a migration) makes Redis fail the whole call ("non local key"), never skip the shard,
# so the client can ask shard by shard instead. Returns [instance, blocks, worst tier rank, confirmed]*.
# Per instance holding the head block: bisect with HEXISTS (about log2(n) probes) for a missing
# position `up` whose predecessor is present (n + 1 when the last block is there), then HMGET
# [1, up) and walk it. A missing field ends every run at or before it, and the walk stops at any
# earlier hole or expired guess, so the answer is exact; a run of r blocks reads r fields, all
# present, so the walk's C fast path takes every chunk of a confirmed device-only run (a range
# past the run's end holds missing fields, which send the chunk down the Lua loop at 1.5-2x the
# cost per field). Field strings are cut from the blob once per script, as far as some run reads.
MATCH = (
    "#!lua flags=allow-cross-slot-keys,no-writes\n"
    + _NOW_MS
    + WALK_CHUNK
    + """
local blob = ARGV[1]
local n = #blob / 8
local fields, cut = {}, 0
local function upto(k)  -- fields[1..k] cut from the blob
  for i = cut + 1, k do fields[i] = string.sub(blob, i * 8 - 7, i * 8) end
  if k > cut then cut = k end
end
local function has(hk, i)
  return redis.call('HEXISTS', hk, string.sub(blob, i * 8 - 7, i * 8)) == 1
end
local function run_of(hk)  -- blocks, confirmed, worst tier rank of hk's leading run (block 1 held)
  local up = n + 1  -- a missing position whose predecessor is present (or n + 1)
  if n > 1 and not has(hk, n) then
    local lo = 2  -- invariant: lo - 1 present, up missing
    up = n
    while lo < up do
      local mid = math.floor((lo + up) / 2)
      if has(hk, mid) then lo = mid + 1 else up = mid end
    end
  end
  -- growing chunks: an earlier hole (rare: removal events out of chain order) stops the read
  -- within max(128, 4 x the run) fields, not at `up`; 4096 at most for unpack's stack
  local pos, conf, worst, conf_open, ended, chunk = 0, 0, 0, true, false, 128
  while pos < up - 1 and not ended do
    local hi = math.min(up - 1, pos + chunk)
    upto(hi)
    local vals = redis.call('HMGET', hk, unpack(fields, pos + 1, hi))
    pos, conf, worst, conf_open, ended = walk_chunk(vals, hi - pos, pos, conf, worst, conf_open)
    chunk = math.min(chunk * 4, 4096)
  end
  return pos, conf, worst
end
local out = {}
local head = string.sub(blob, 1, 8)
for a = 2, #ARGV do
  local pre = ARGV[a] .. 'i:'
  for _, inst in ipairs(redis.call('SMEMBERS', ARGV[a] .. 'instances')) do
    local hk = pre .. inst
    if redis.call('HEXISTS', hk, head) == 1 then
      local pos, conf, worst = run_of(hk)
      if pos > 0 then
        out[#out + 1] = inst
        out[#out + 1] = pos
        out[#out + 1] = worst
        out[#out + 1] = conf
      end
    end
  end
end
return out
"""
)
