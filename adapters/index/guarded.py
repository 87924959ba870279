"""A shared (Redis) index behind a circuit breaker, with an in-process copy to fall back on.

Why: the index look-up sits on every request's path. A Redis that hangs must cost a request at
most one short timeout, and once it has failed a few times in a row, nothing at all (the breaker,
`adapters/breaker.py`); a Redis that is absent at start-up must not stop the gateway (nothing here
connects before the first call); and a Redis that comes back is used again without a restart.

While Redis cannot be used, look-ups fall back to `fallback`: a bounded `MemoryIndex` that every
write also goes to. Each replica subscribes to the workers' KV events itself, so that copy knows
everything the workers confirmed (it lacks only the other replicas' dispatch guesses). Without a
fallback a look-up answers "nothing cached", which routes correctly, only blind to the cache.

Writes that Redis missed leave it stale: a missed BlockStored hides a cached prefix, a missed
BlockRemoved advertises one that is gone. So every instance with a missed write is marked, and
once Redis answers again it is re-seeded from the local copy: its entries in Redis dropped and the
confirmed ones written back (other replicas' guesses for it are lost; they expire in seconds anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from adapters.breaker import BreakerState, CircuitBreaker
from adapters.index.base import TIER_BITS, IndexStats, KVIndex, MemoryUse, PrefixMatch, Write, apply_writes, check_write
from adapters.index.memory import MemoryIndex
from conductor.core.types import Tier

log = logging.getLogger(__name__)

RESEED_CHUNK = 4096  # keys per insert while re-seeding: one Lua call of a few milliseconds


def _false() -> bool:
    return False


class GuardedIndex:
    """KVIndex over another (remote) KVIndex: bounded calls, a breaker and a local fallback."""

    def __init__(
        self,
        primary: KVIndex,
        breaker: CircuitBreaker,
        *,
        fallback: MemoryIndex | None = None,
        lookup_timeout_s: float = 0.05,
        write_timeout_s: float = 0.25,
    ) -> None:
        self.primary = primary
        self.breaker = breaker
        self.fallback = fallback
        self.limits = primary.limits
        self.lookup_timeout_s = lookup_timeout_s
        self.write_timeout_s = write_timeout_s
        self.fallback_lookups = 0  # look-ups answered without the primary
        self.missed_writes = 0  # writes the primary did not take (failed or not attempted)
        self.reseeds = 0  # instances re-seeded into the primary after it missed writes
        self.slowest_fallback_lookup_s = 0.0  # the longest a look-up took when it ended in the fallback
        self._dirty: set[str] = set()  # instances whose writes the primary missed
        self._reseeding: asyncio.Task[None] | None = None

    async def probe(self) -> bool:
        """One bounded call at start-up, so an absent Redis is reported then, not at the first requests."""
        if await self._attempt(self.primary.stats):
            return True
        log.warning(
            "KV index: the shared index is not reachable (%s); look-ups use %s until it is, and the "
            "gateway picks it up when it answers",
            self.breaker.stats.last_error,
            "this replica's local copy" if self.fallback is not None else "no cache knowledge",
        )
        return False

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        if self.fallback is not None:
            self.fallback.insert_sync(instance, keys, tier=tier, confirmed=confirmed)
        await self._write(instance, lambda: self.primary.insert(instance, keys, tier=tier, confirmed=confirmed))

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        if self.fallback is not None:
            await self.fallback.remove(instance, keys, tier=tier)
        await self._write(instance, lambda: self.primary.remove(instance, keys, tier=tier))

    async def drop_instance(self, instance: str) -> None:
        if self.fallback is not None:
            await self.fallback.drop_instance(instance)
        await self._write(instance, lambda: self.primary.drop_instance(instance))

    async def apply(self, instance: str, writes: Sequence[Write]) -> None:
        """A batch of writes: the local copy takes them all, the primary in one call (one breaker
        attempt, one missed write when it fails)."""
        for kind, bits, _ in writes:
            check_write(kind, bits)  # bad input is the caller's error, not Redis failing the breaker
        if self.fallback is not None:
            self.fallback.apply_sync(instance, writes)
        await self._write(instance, lambda: apply_writes(self.primary, instance, writes))

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        if not keys:
            return PrefixMatch()
        fallbacks = self.fallback_lookups
        started = time.perf_counter()
        found = await self.breaker.call(
            lambda: self.primary.match(keys), lambda: self._local_match(keys), timeout_s=self.lookup_timeout_s
        )
        if self.fallback_lookups != fallbacks:  # what a look-up cost the request when Redis let it down
            self.slowest_fallback_lookup_s = max(self.slowest_fallback_lookup_s, time.perf_counter() - started)
        self._maybe_reseed()
        return found

    def _local_match(self, keys: Sequence[int]) -> PrefixMatch:
        self.fallback_lookups += 1
        return self.fallback.match_sync(keys) if self.fallback is not None else PrefixMatch()

    async def stats(self) -> IndexStats:
        found = await self.breaker.call(self.primary.stats, lambda: None, timeout_s=self.write_timeout_s)
        if found is not None:
            return found
        return await self.fallback.stats() if self.fallback is not None else IndexStats(blocks=0, evictions=0)

    def memory(self) -> MemoryUse | None:
        """The in-process part (the fallback copy); the primary's memory is the server's."""
        return self.fallback.memory() if self.fallback is not None else None

    async def clear(self) -> int:
        """Delete everything the primary holds under its prefix (tests, an operator's reset)."""
        clear: Callable[[], Awaitable[int]] | None = getattr(self.primary, "clear", None)
        if self.fallback is not None:
            await self.fallback.close()  # a memory index's close() empties it, and it stays usable
        return await clear() if clear is not None else 0

    async def close(self) -> None:
        if self._reseeding is not None:
            self._reseeding.cancel()
            await asyncio.gather(self._reseeding, return_exceptions=True)
        await self.primary.close()
        if self.fallback is not None:
            await self.fallback.close()

    async def _attempt(self, op: Callable[[], Awaitable[object]]) -> bool:
        async def run() -> bool:
            await op()
            return True

        return await self.breaker.call(run, _false, timeout_s=self.write_timeout_s)

    async def _write(self, instance: str, op: Callable[[], Awaitable[object]]) -> None:
        if not await self._attempt(op):
            self.missed_writes += 1
            if self.fallback is not None:  # without a local copy there is nothing to re-seed from
                self._dirty.add(instance)
        self._maybe_reseed()

    def _maybe_reseed(self) -> None:
        if self._dirty and self._reseeding is None and self.breaker.state is BreakerState.CLOSED:
            self._reseeding = asyncio.create_task(self._reseed_dirty(), name="kv-index-reseed")
            self._reseeding.add_done_callback(self._reseed_done)

    def _reseed_done(self, task: asyncio.Task[None]) -> None:
        self._reseeding = None

    async def _reseed_dirty(self) -> None:
        while self._dirty:
            instance = self._dirty.pop()
            if not await self._reseed(instance):
                self._dirty.add(instance)  # the primary failed again: the next success retries
                return
            self.reseeds += 1
            log.info("KV index: re-seeded %s into the shared index after it missed writes", instance)

    async def _reseed(self, instance: str) -> bool:
        assert self.fallback is not None
        entries = self.fallback.confirmed_snapshot(instance)
        if not await self._attempt(lambda: self.primary.drop_instance(instance)):
            return False
        for tier, bit in TIER_BITS.items():
            keys = [k for k, bits in entries if bits & bit]
            for lo in range(0, len(keys), RESEED_CHUNK):
                if not await self._attempt(self._inserter(instance, keys[lo : lo + RESEED_CHUNK], tier)):
                    return False
        return True

    def _inserter(self, instance: str, keys: Sequence[int], tier: Tier) -> Callable[[], Awaitable[None]]:
        return lambda: self.primary.insert(instance, keys, tier=tier, confirmed=True)
