"""The shared cache index on Redis: every gateway replica reads and writes the same blocks.

Instance-major layout under one key prefix P (one prefix per deployment, or per test):
- P i:<instance>  hash {8-byte block key: value}, value "<tier bits>" for a confirmed block or
                  "u<expiry ms>" for a dispatch guess (plus one "~" marker field); the hash
                  expires after key_ttl_s without an insert for that instance (inserts are the
                  touch that re-arms it);
- P instances     set of instance names that hold entries;
- P lru           sorted set of <instance><8-byte key> by last touch: LRU order for the cap;
- P clock         counter the touch scores come from (strict order across replicas);
- P evictions     counter of entries dropped to stay under max_blocks.

Every operation is one round trip: a Lua script does the whole job server-side, and the keys travel
as one packed binary argument so the client never builds thousands of per-key strings. A batch of
writes for one instance (`apply`: an event batch's stores, removals and clears, in order) is one
script call as well, so the event feed costs one round trip per received batch, not one per event.
The prefix match asks each instance that holds the first block for its blocks in growing HMGET
chunks, so a fully cached 8,192-block prompt costs a handful of commands, not 8,192. Block keys are built
inside the scripts, so this needs a single Redis node (or one Cluster slot), not a sharded
Cluster. Dispatch guesses expire by Redis's own clock (TIME), so gateways with skewed clocks
agree. Redis 7.0 has no per-field expiry, so a block's entry lives until the cap evicts it, a
removal event, or its whole instance hash expiring (an instance nobody touched for key_ttl_s);
LRU members of an expired hash are harmless and leave through the cap like any other.

Calls in flight: at most CALLS_IN_FLIGHT per client (look-ups, writes); more wait their turn
(CallGate), within the client's timeout. redis-py's pool fails a call past 100 connections at once
(MaxConnectionsError): with hundreds of instances' feeds writing at the same time that dropped event
batches, and behind the breaker (GuardedIndex) counted as Redis failing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from adapters.breaker import fail_fast_redis
from adapters.index.base import (
    DROP,
    IndexLimits,
    IndexStats,
    PrefixMatch,
    SingleWritesByApply,
    Write,
    check_write,
)
from conductor.core.types import Tier

_NOW_MS = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# KEYS: instances, lru, evictions, clock. ARGV: prefix, instance, unconfirmed ttl ms, key ttl ms, cap,
# the packed keys of all writes, then per write (base.Write, in order): kind, tier bits, key count.
# A whole event batch (or one insert / remove / drop) is this one script: one round trip.
# Returns the entries evicted.
_APPLY = (
    _NOW_MS
    + """
local prefix, inst = ARGV[1], ARGV[2]
local unconf_ms, ttl_ms, cap, blob = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local hk = prefix .. 'i:' .. inst
local guess = 'u' .. (now + unconf_ms)

-- n keys from byte offset `at` of the blob, in tier bit tbit (confirmed) or as dispatch guesses
local function insert(at, n, tbit, confirmed)
  -- LRU scores come from one shared counter, so touches from every replica are strictly ordered
  local base = redis.call('INCRBY', KEYS[4], n) - n
  redis.call('SADD', KEYS[1], inst)
  if redis.call('EXISTS', hk) == 0 then
    -- one long-valued marker field forces the hashtable encoding from the start: a small hash would
    -- otherwise be a listpack, where every HMGET field is a linear scan (3-5x slower lookups)
    redis.call('HSET', hk, '~', string.rep('-', 65))
  end
  for lo = 0, n - 1, 1000 do
    local hi = math.min(n, lo + 1000) - 1
    local fields = {}
    for i = lo, hi do fields[#fields + 1] = string.sub(blob, at + i * 8 + 1, at + i * 8 + 8) end
    local old = redis.call('HMGET', hk, unpack(fields))
    local sets, touch = {}, {}
    for j = 1, #fields do
      local v = old[j]
      local f = fields[j]
      if confirmed then
        local b = 0
        if v and string.byte(v, 1) ~= 117 then b = tonumber(v) end
        sets[#sets + 1] = f
        sets[#sets + 1] = tostring(bit.bor(b, tbit))
      elseif not v or string.byte(v, 1) == 117 then
        sets[#sets + 1] = f
        sets[#sets + 1] = guess
      end
      -- the head of a prompt gets the newest score, so eviction eats chains from their tails
      touch[#touch + 1] = base + n - (lo + j - 1)
      touch[#touch + 1] = inst .. f
    end
    if #sets > 0 then redis.call('HSET', hk, unpack(sets)) end
    redis.call('ZADD', KEYS[2], unpack(touch))
  end
  redis.call('PEXPIRE', hk, ttl_ms)
  -- the cap after every insert, as separate calls would have it (not once per batch: a removal
  -- later in the batch must not spare what an earlier insert pushed out)
  local excess = redis.call('ZCARD', KEYS[2]) - cap
  if excess <= 0 then return 0 end
  local victims = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #victims, 2 do
    local m = victims[i]
    redis.call('HDEL', prefix .. 'i:' .. string.sub(m, 1, -9), string.sub(m, -8))
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
        redis.call('ZREM', KEYS[2], inst .. f)
      else
        redis.call('HSET', hk, f, tostring(b))
      end
    end
  end
end

local evicted, at = 0, 0
for w = 7, #ARGV, 3 do
  local kind, bits, n = tonumber(ARGV[w]), tonumber(ARGV[w + 1]), tonumber(ARGV[w + 2])
  if kind <= 1 then
    evicted = evicted + insert(at, n, bits, kind == 0)
  elseif kind == 2 then
    remove(at, n, bits)
  else
    -- the instance's LRU members stay until trimmed; evicting one then is a harmless HDEL
    redis.call('UNLINK', hk)
    redis.call('SREM', KEYS[1], inst)
  end
  at = at + n * 8
end
return evicted
"""
)

# One HMGET chunk of a run, walked in order; both match scripts (this one and the cluster's) use it.
# In: the chunk's values, how many, and the run so far (blocks, confirmed blocks, worst tier rank,
# whether the confirmed run is still unbroken). Out: the run after the chunk, and whether it ended
# inside the chunk (a missing field or an expired dispatch guess). Needs `now` (_NOW_MS) before it.
WALK_CHUNK = """
local function walk_chunk(vals, count, pos, conf, worst, conf_open)
  -- fast path, in C: a chunk of confirmed device-only blocks concatenates to "111...1"
  -- (a missing field is `false`, which makes table.concat fail: then take the slow path)
  local ok, joined = pcall(table.concat, vals)
  if ok and conf_open and joined == string.rep('1', count) then
    return pos + count, conf + count, worst, conf_open, false
  end
  for j = 1, count do
    local v = vals[j]
    if v == '1' then  -- the common case: confirmed, device only
      if conf_open then conf = conf + 1 end
    elseif not v then
      return pos, conf, worst, conf_open, true
    elseif string.byte(v, 1) == 117 then
      if tonumber(string.sub(v, 2)) <= now then return pos, conf, worst, conf_open, true end
      conf_open = false
    else
      local b = tonumber(v)
      local rank = 2
      if bit.band(b, 1) == 1 then rank = 0 elseif bit.band(b, 2) == 2 then rank = 1 end
      if rank > worst then worst = rank end
      if conf_open then conf = conf + 1 end
    end
    pos = pos + 1
  end
  return pos, conf, worst, conf_open, false
end
"""

# KEYS: instances. ARGV: prefix, packed keys. Returns [instance, blocks, worst tier rank, confirmed]*.
_MATCH = (
    _NOW_MS
    + WALK_CHUNK
    + """
local prefix, blob = ARGV[1], ARGV[2]
local n = #blob / 8
local first = string.sub(blob, 1, 8)
local out = {}
local fields = nil
for _, inst in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local hk = prefix .. 'i:' .. inst
  if redis.call('HEXISTS', hk, first) == 1 then
    if fields == nil then
      fields = {}
      for i = 0, n - 1 do fields[i + 1] = string.sub(blob, i * 8 + 1, i * 8 + 8) end
    end
    local pos, conf, worst, conf_open, stop = 0, 0, 0, true, false
    local chunk = 32
    while pos < n and not stop do
      local hi = math.min(n, pos + chunk)
      local vals = redis.call('HMGET', hk, unpack(fields, pos + 1, hi))
      local ended
      pos, conf, worst, conf_open, ended = walk_chunk(vals, hi - pos, pos, conf, worst, conf_open)
      stop = stop or ended
      chunk = math.min(chunk * 4, 4096)
    end
    if pos > 0 then
      out[#out + 1] = inst
      out[#out + 1] = pos
      out[#out + 1] = worst
      out[#out + 1] = conf
    end
  end
end
return out
"""
)


_RANK_TIER = (Tier.DEVICE, Tier.HOST, Tier.STORE)


def match_from_replies(replies: Sequence[Sequence[Any]]) -> PrefixMatch:
    """PrefixMatch from the match scripts' answers, each [instance, blocks, worst tier rank,
    confirmed blocks]* (one answer from a single node, one per shard from a cluster)."""
    blocks: dict[str, int] = {}
    tiers: dict[str, Tier] = {}
    confirmed: dict[str, int] = {}
    for raw in replies:
        for i in range(0, len(raw), 4):
            name = raw[i].decode() if isinstance(raw[i], bytes) else str(raw[i])
            blocks[name] = int(raw[i + 1])
            tiers[name] = _RANK_TIER[int(raw[i + 2])]
            if int(raw[i + 3]):
                confirmed[name] = int(raw[i + 3])
    return PrefixMatch(blocks=blocks, tiers=tiers, confirmed_blocks=confirmed)


def pack_keys(keys: Sequence[int]) -> bytes:
    """Keys as one big-endian uint64 blob: one argument instead of thousands."""
    return np.asarray(keys, dtype=np.uint64).astype(">u8").tobytes()


CALLS_IN_FLIGHT = 64  # per client: under redis-py's pool cap (100), and Redis runs one script at a time


class CallGate:
    """At most `limit` calls in flight through one client; the others wait their turn, at most
    `timeout_s` (then TimeoutError). asyncio.Semaphore hands a freed place to the longest waiter, so
    busy callers never starve the rest (redis-py's BlockingConnectionPool does not: a task that
    releases a connection can take it straight back, and waiters timed out under a steady feed)."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self._places = asyncio.Semaphore(limit)
        self._timeout_s = timeout_s

    async def __aenter__(self) -> None:
        if self._places.locked():
            async with asyncio.timeout(self._timeout_s):
                await self._places.acquire()
        else:
            await self._places.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._places.release()


def pack_writes(writes: Sequence[Write]) -> tuple[bytes, list[int]]:
    """The apply scripts' arguments for a batch of writes: every write's keys in one packed blob, in
    order, and (kind, tier bits, key count) per write. Writes without keys are left out (an empty
    insert or removal changes nothing; the single-write methods never sent one), except DROP."""
    flat: list[int] = []
    spec: list[int] = []
    for kind, bits, keys in writes:
        check_write(kind, bits)
        if kind == DROP:
            spec += (DROP, 0, 0)
        elif keys:
            flat.extend(keys)
            spec += (kind, bits, len(keys))
    return pack_keys(flat), spec


class RedisIndex(SingleWritesByApply):
    """KVIndex on a shared Redis. `prefix` isolates deployments (and tests) on one server."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "conductor:kv:",
        limits: IndexLimits | None = None,
        client: aioredis.Redis | None = None,
        timeout_s: float = 0.5,
        write_timeout_s: float = 2.0,
    ) -> None:
        """timeout_s bounds a lookup (it sits on the request path); write_timeout_s bounds the inserts
        and removals that feeds and dispatches make beside the requests (the gateway passes its
        kv.redis_*timeout_s settings, tighter than these library defaults). Two clients, so a slow
        write never holds a lookup's connection. Nothing connects before the first call: a Redis
        that is absent at start-up costs nothing until then."""
        self.limits = limits or IndexLimits()
        self.prefix = prefix
        self._own_client = client is None
        self._read: aioredis.Redis = client or fail_fast_redis(url, timeout_s=timeout_s)
        self._redis: aioredis.Redis = client or fail_fast_redis(url, timeout_s=write_timeout_s)
        self._write_gate = CallGate(CALLS_IN_FLIGHT, write_timeout_s)
        self._read_gate = self._write_gate if client is not None else CallGate(CALLS_IN_FLIGHT, timeout_s)
        self._k_instances = f"{prefix}instances"
        self._k_lru = f"{prefix}lru"
        self._k_evictions = f"{prefix}evictions"
        self._k_clock = f"{prefix}clock"
        self._apply_keys = [self._k_instances, self._k_lru, self._k_evictions, self._k_clock]
        self._apply = self._redis.register_script(_APPLY)
        self._match = self._read.register_script(_MATCH)

    async def apply(self, instance: str, writes: Sequence[Write]) -> None:
        """All of `writes`, in order, in one script call (see _APPLY)."""
        blob, spec = pack_writes(writes)
        if not spec:
            return
        limits = self.limits
        args: list[Any] = [
            self.prefix,
            instance,
            int(limits.unconfirmed_ttl_s * 1000),
            int(limits.key_ttl_s * 1000),
            limits.max_blocks,
            blob,
            *spec,
        ]
        async with self._write_gate:
            await self._apply(keys=self._apply_keys, args=args)

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        if not keys:
            return PrefixMatch()
        async with self._read_gate:
            raw = await self._match(keys=[self._k_instances], args=[self.prefix, pack_keys(keys)])
        return match_from_replies([raw])

    async def stats(self) -> IndexStats:
        async with self._write_gate, self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._k_lru)
            pipe.get(self._k_evictions)
            pipe.smembers(self._k_instances)
            blocks, evictions, names = await pipe.execute()
        return IndexStats(
            blocks=int(blocks),
            evictions=int(evictions or 0),
            instances=tuple(sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)),
        )

    async def clear(self) -> int:
        """Delete every key under this prefix (tests, and an operator's reset); returns the count."""
        deleted = 0
        async for batch in _scan_batches(self._redis, f"{self.prefix}*"):
            deleted += await self._redis.unlink(*batch)
        return deleted

    async def close(self) -> None:
        if self._own_client:
            await self._read.aclose()
            await self._redis.aclose()


async def _scan_batches(client: aioredis.Redis, pattern: str, batch: int = 1000) -> Any:
    keys: list[bytes] = []
    async for key in client.scan_iter(match=pattern, count=batch):
        keys.append(key)
        if len(keys) >= batch:
            yield keys
            keys = []
    if keys:
        yield keys
