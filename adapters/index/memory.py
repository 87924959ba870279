"""The embedded, in-process cache index: bounded, LRU by last insert, evictions counted.

Instance-major layout: per instance, one ordered dict of confirmed blocks {key: tier bits} and one
of unconfirmed (dispatch-only) blocks {key: expiry}. A prefix match then asks, per instance that
holds the first block, how far a C-level `takewhile(dict.__contains__, keys)` runs: about 30 ns a
block instead of a Python loop over every (block, instance) pair, so a fully cached 128K-token
prompt at block size 16 (8,192 blocks) matches in a fraction of a millisecond.

Recency is refreshed by inserts (dispatches and events), not by lookups: a lookup touching every
block would cost a write per block on the hot path, and a dispatch re-inserts the prompt's keys
anyway. Inserts walk the keys tail first, so the head of a prompt is the most recently touched
and LRU eviction eats chains from their ends, keeping each instance's set prefix-closed.

The gateway sizes it in bytes (kv.index_memory_bytes): the cap is the budget over ENTRY_BYTES.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from adapters.index.base import (
    ALL_TIER_BITS,
    DROP,
    GUESS,
    REMOVE,
    STORE,
    TIER_BITS,
    IndexLimits,
    IndexStats,
    MemoryUse,
    PrefixMatch,
    Write,
    check_write,
    entries_within,
)
from conductor.core.memory_budgets import DEFAULT_INDEX_BUDGET_BYTES as DEFAULT_INDEX_BUDGET_BYTES  # re-exported
from conductor.core.types import Tier

# Bytes one (instance, block) entry costs at worst, measured with tracemalloc
# (tests/adapters/index/test_memory_budget.py measures it again): three instances, confirmed and
# guessed entries, the index kept full while 3x its cap streamed through, caps from 20,000 to
# 411,000 swept finely around the hash tables' resize points. Peak traced bytes (tables mid-resize
# included) over the entries held, plus the 48-byte int object of each 64-bit key (the index alone
# keeps it once its request is gone): 176 to 256.4 bytes, the worst just past a resize point
# (caps of ~48,000 and ~196,200); a steady full index averages 141. Budgets use the worst case
# plus ~6% (allocator slack tracemalloc does not see), so a budget is a bound, not a hope.
ENTRY_BYTES = 272
# DEFAULT_INDEX_BUDGET_BYTES (conductor/core/memory_budgets.py): 185,042 entries


def blocks_within(budget_bytes: int) -> int:
    """The entry cap an in-process index of `budget_bytes` gets."""
    return entries_within(budget_bytes, ENTRY_BYTES)


_RANK_TIER = (Tier.DEVICE, Tier.HOST, Tier.STORE)
# tier bits -> rank of the fastest tier present (0 device, 1 host, 2 store); index 0 unused
_RANK_OF_BITS = tuple(0 if b & 1 else 1 if b & 2 else 2 for b in range(ALL_TIER_BITS + 1))


@dataclass(slots=True)
class _Holdings:
    """One instance's blocks. Both dicts are in touch order, oldest first."""

    confirmed: OrderedDict[int, int] = field(default_factory=OrderedDict)  # key -> tier bits
    unconfirmed: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> expiry
    only_device: bool = True  # no host/store tier seen: the tier of any run is "device"

    def size(self) -> int:
        return len(self.confirmed) + len(self.unconfirmed)

    def purge(self, now: float) -> None:
        # All unconfirmed entries share one TTL, so touch order is expiry order.
        unconfirmed = self.unconfirmed
        while unconfirmed:
            until = next(iter(unconfirmed.values()))
            if until > now:
                break
            unconfirmed.popitem(last=False)


def _lead(d: Container[int], keys: Sequence[int], start: int) -> int:
    """How many of keys[start:] in a row are in `d` (C-level loop)."""
    return len(list(takewhile(d.__contains__, keys[start:])))


class MemoryIndex:
    """In-memory KVIndex. Not shared between processes; used from one event loop."""

    def __init__(self, limits: IndexLimits | None = None, *, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or IndexLimits()
        self._clock = clock
        self._by_instance: dict[str, _Holdings] = {}
        self._total = 0
        self._evictions = 0

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        self.insert_sync(instance, keys, tier=tier, confirmed=confirmed)

    def insert_sync(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        self._insert(instance, keys, TIER_BITS[tier], confirmed)

    async def apply(self, instance: str, writes: Sequence[Write]) -> None:
        self.apply_sync(instance, writes)

    def apply_sync(self, instance: str, writes: Sequence[Write]) -> None:
        """`apply`, synchronously: each write exactly as its single-write method would do it, in order."""
        for kind, bits, _ in writes:
            check_write(kind, bits)  # all checked first: a bad write leaves the batch unapplied
        for kind, bits, keys in writes:
            if kind in (STORE, GUESS):
                self._insert(instance, keys, bits, kind == STORE)
            elif kind == REMOVE:
                self._remove(instance, keys, bits)
            else:
                assert kind == DROP
                self._drop(instance)

    def _insert(self, instance: str, keys: Sequence[int], bit: int, confirmed: bool) -> None:
        h = self._by_instance.get(instance)
        if h is None:
            h = self._by_instance[instance] = _Holdings()
        before = h.size()
        if confirmed:
            if bit != TIER_BITS[Tier.DEVICE]:
                h.only_device = False
            conf, unconf = h.confirmed, h.unconfirmed
            for key in reversed(keys):
                bits = conf.pop(key, 0)
                conf[key] = bits | bit
                unconf.pop(key, None)  # the event confirms the guess
        else:
            until = self._clock() + self.limits.unconfirmed_ttl_s
            conf, unconf = h.confirmed, h.unconfirmed
            for key in reversed(keys):
                if key in conf:
                    conf.move_to_end(key)
                    continue
                unconf.pop(key, None)
                unconf[key] = until
        self._total += h.size() - before
        if self._total > self.limits.max_blocks:
            self._evict(self._total - self.limits.max_blocks)

    def _evict(self, count: int) -> None:
        # Take from the biggest holder: one busy instance cannot starve the others of index space.
        now = self._clock()
        for h in self._by_instance.values():
            self._purge(h, now)  # expired guesses go first, and are not evictions
        count = self._total - self.limits.max_blocks
        while count > 0:
            h = max(self._by_instance.values(), key=_Holdings.size)
            take = min(count, h.size())
            for _ in range(take):
                # unconfirmed guesses are cheaper to lose than what a worker confirmed
                (h.unconfirmed if h.unconfirmed else h.confirmed).popitem(last=False)
            self._total -= take
            self._evictions += take
            count -= take

    def _purge(self, h: _Holdings, now: float) -> None:
        before = h.size()
        h.purge(now)
        self._total -= before - h.size()

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        self._remove(instance, keys, ALL_TIER_BITS if tier is None else TIER_BITS[tier])

    def _remove(self, instance: str, keys: Sequence[int], mask: int) -> None:
        h = self._by_instance.get(instance)
        if h is None:
            return
        before = h.size()
        conf, unconf = h.confirmed, h.unconfirmed
        for key in keys:
            unconf.pop(key, None)  # the worker just said it is gone: the guess goes too
            bits = conf.get(key)
            if bits is None:
                continue
            bits &= ~mask
            if bits:
                conf[key] = bits
            else:
                del conf[key]
        self._total -= before - h.size()

    async def drop_instance(self, instance: str) -> None:
        self._drop(instance)

    def _drop(self, instance: str) -> None:
        h = self._by_instance.pop(instance, None)
        if h is not None:
            self._total -= h.size()

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        return self.match_sync(keys)

    def match_sync(self, keys: Sequence[int]) -> PrefixMatch:
        if not keys:
            return PrefixMatch()
        if not isinstance(keys, list | tuple):
            keys = list(keys)
        first = keys[0]
        now = self._clock()
        blocks: dict[str, int] = {}
        tiers: dict[str, Tier] = {}
        confirmed: dict[str, int] = {}
        total = len(keys)
        for name, h in self._by_instance.items():
            conf, unconf = h.confirmed, h.unconfirmed
            if first not in conf and first not in unconf:
                continue
            self._purge(h, now)
            n = n_conf = _lead(conf, keys, 0)
            # Alternate between confirmed and guessed runs until neither advances.
            while n < total and unconf:
                step = _lead(unconf, keys, n)
                if not step:
                    break
                n += step
                step = _lead(conf, keys, n)
                if not step:
                    break
                n += step
            if not n:
                continue
            blocks[name] = n
            if n_conf:
                confirmed[name] = n_conf
            if h.only_device:
                tiers[name] = Tier.DEVICE
            else:
                ranks = [_RANK_OF_BITS[b] for b in map(conf.get, keys[:n]) if b]
                tiers[name] = _RANK_TIER[max(ranks, default=0)]
        return PrefixMatch(blocks=blocks, tiers=tiers, confirmed_blocks=confirmed)

    async def stats(self) -> IndexStats:
        return IndexStats(blocks=self._total, evictions=self._evictions, instances=tuple(self._by_instance))

    def memory(self) -> MemoryUse:
        """Synchronous, for the metrics scrape: entries held and their estimated bytes."""
        return MemoryUse(self._total, self._total * ENTRY_BYTES, self.limits.max_blocks, self._evictions)

    def confirmed_snapshot(self, instance: str) -> list[tuple[int, int]]:
        """(key, tier bits) of what events confirmed on `instance`, oldest first (to re-seed a shared
        index that missed writes while it was unreachable)."""
        h = self._by_instance.get(instance)
        return list(h.confirmed.items()) if h is not None else []

    def instances(self) -> tuple[str, ...]:
        return tuple(self._by_instance)

    async def close(self) -> None:
        self._by_instance.clear()
        self._total = 0

    def __len__(self) -> int:
        return self._total
