"""Replicas that decide in turn: one fleet-wide Redis lock around "read the others' load, decide,
publish what was dispatched" (`load_share.turns: true`).

Why: replicas sharing load through Redis (adapters/load_share.py) were still blind to each other
for a few milliseconds after every dispatch -- until the dispatcher's next exchange published it
and the other replica's next read fetched it. Arrivals come in bursts, and three replicas deciding
the same burst each queued their prefill on an instance whose queue they saw without the others'.
Measured on their decision logs (bench_replicas.py, the prefill queues replayed FCFS from all
three logs): a third of the admitted requests had their queue under-predicted by more than 50 ms,
always behind prefills another replica had dispatched 1-20 ms before; each replica's TTFT MAPE was
30-40% against 5-10% for one gateway, and the calibrated bound turned that error into rejections.
A single gateway decides on one event loop, so each decision sees every earlier dispatch.

Replicas taking turns do too. A decision first takes the turn: one script call that sets the turn
key to this replica (NX, expiring after `hold_s`) and, when that succeeded, returns every other
live replica's published load table in the same round trip. The decision is made and the request
dispatched on the event loop before anything else runs; then (`release`, scheduled to run after
it) one pipelined call publishes this replica's table, which now holds the dispatch, and deletes
the turn key if it is still this replica's. Requests of this replica arriving while it holds the
turn decide under the same turn. A replica waiting for the turn retries every `poll_s`; after
`max_wait_s` it decides on what it last saw (as without turns), so a holder that died costs at
most its key's expiry and no request waits long. Redis unreachable: the breaker of the load share
answers and the replica decides on its own load, as before.

The cost: decisions are serialized across the fleet, about three Redis round trips each (take,
publish-and-release, and the wait for whoever holds it): a fleet-wide ceiling of some hundreds of
decisions a second on one box. That is why it is a setting, off by default.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger(__name__)

# KEYS: turn key, members zset. ARGV: replica id, hold ms, table key prefix, oldest live score.
# Returns false (the turn is someone else's) or {1, table, table, ...} of the other replicas.
_TAKE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
local out = {1}
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if m ~= ARGV[1] then
    local t = redis.call('GET', ARGV[3] .. m)
    if t then out[#out + 1] = t end
  end
end
return out
"""
# KEYS: turn key. ARGV: replica id. Deletes the turn only if it is still this replica's.
_GIVE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class DecisionTurn:
    """The turn of replica `replica_id` among those publishing under `prefix` (see the module)."""

    def __init__(
        self,
        replica_id: str,
        prefix: str,
        *,
        hold_s: float = 0.05,
        poll_s: float = 0.001,
        max_wait_s: float = 0.25,
        ttl_s: float = 1.0,
    ) -> None:
        self.replica_id = replica_id
        self._prefix = prefix
        self._key = f"{prefix}turn"
        self._members = f"{prefix}replicas"
        self.hold_ms = max(1, int(hold_s * 1000))  # the longest a replica that died holding the turn keeps it
        self._poll_s = poll_s
        self.max_wait_s = max_wait_s
        self._ttl_s = ttl_s
        self.holding = False  # this replica holds the turn: its decisions until the release are under it
        self.counts = {"taken": 0, "waits": 0, "timeouts": 0}

    async def take(self, redis: aioredis.Redis) -> list[bytes] | None:
        """Wait for the turn; the other replicas' tables read with it, or None after max_wait_s
        (decide without it). Raises what Redis raises."""
        started = time.monotonic()
        waited = False
        while True:
            got = await redis.eval(
                _TAKE, 2, self._key, self._members, self.replica_id, self.hold_ms, self._prefix, time.time() - self._ttl_s
            )
            if got:
                self.holding = True
                self.counts["taken"] += 1
                self.counts["waits"] += waited
                return [t for t in got[1:] if isinstance(t, bytes)]
            waited = True
            if time.monotonic() - started >= self.max_wait_s:
                self.counts["timeouts"] += 1
                return None
            await asyncio.sleep(self._poll_s)

    async def give(self, redis: aioredis.Redis, table: bytes, table_key: str, ttl_ms: int) -> None:
        """Publish this replica's table (with what it just dispatched) and give the turn back
        (`holding` is cleared by the caller when it takes the table, not here: a decision made
        after that is not in the table, so it must not count as made under this turn)."""
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(table_key, table, px=ttl_ms)
            pipe.zadd(self._members, {self.replica_id: time.time()})
            pipe.eval(_GIVE, 1, self._key, self.replica_id)
            await pipe.execute()


class FdTurn:
    """The worker processes of one gateway (`--workers N`) deciding in turn: an exclusive flock on
    a file each opened for itself (the shared memory segment's, adapters/shm_load_share.py).

    The same blindness as between replicas, shorter: a sibling deciding while this process decides
    did not see the dispatch this process was about to make (published after its step). The lock
    is taken before the decision without a system call's wait (LOCK_NB; retried every `poll_s`
    while a sibling holds it, given up after `max_wait_s`), and given back once the decision's
    step has run and the table holding its dispatch is published. The kernel drops the lock of a
    process that dies. Where flock is not supported on that file, `take` says so once and the
    process decides without turns."""

    def __init__(self, fd: int, *, poll_s: float = 0.0002, max_wait_s: float = 0.05) -> None:
        self._fd = fd
        self._poll_s = poll_s
        self.max_wait_s = max_wait_s
        self.holding = False
        self.counts = {"taken": 0, "waits": 0, "timeouts": 0}

    async def take(self) -> bool:
        """Hold the lock when this returns True (at once, with no await, when no sibling holds it)."""
        started = None
        while self._fd >= 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            except OSError as exc:  # not supported here: decide without turns from now on
                log.warning("worker processes cannot take turns to decide (flock: %s): each decides on its own view", exc)
                self._fd = -1
                return False
            else:
                self.holding = True
                self.counts["taken"] += 1
                self.counts["waits"] += started is not None
                return True
            now = time.monotonic()
            if started is None:
                started = now
            elif now - started >= self.max_wait_s:
                self.counts["timeouts"] += 1
                return False
            await asyncio.sleep(self._poll_s)
        return False

    def give(self) -> None:
        if self.holding:
            self.holding = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)
