"""The global KV cache index: block key -> which instances hold that block, and in which tier.

One small async protocol, two backends: `memory.MemoryIndex` (embedded, one gateway) and
`redis.RedisIndex` (shared by every gateway replica). Both are bounded (a block cap with LRU
eviction, counted) and both keep two kinds of entries per (block, instance):

- confirmed: the worker said so in a KV event (BlockStored); it stays until BlockRemoved,
  AllBlocksCleared, the instance being dropped, or eviction;
- unconfirmed: the gateway dispatched the prompt there and assumes the worker cached it; it
  expires after `unconfirmed_ttl_s` unless an event confirms it.

Entries are kept per instance (instance-major), so dropping an instance is one operation and a
prefix match costs one short scan per instance that holds the prompt's first block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from conductor.core.types import CachedPrefix, Tier

# Tier bits stored per (block, instance); a block may sit in both HBM and DRAM (offloading).
TIER_BITS: Mapping[Tier, int] = {Tier.DEVICE: 1, Tier.HOST: 2, Tier.STORE: 4}
ALL_TIER_BITS = 7


def tier_of_bits(bits: int) -> Tier:
    """The fastest tier present in a bit set (device beats host beats store)."""
    if bits & 1:
        return Tier.DEVICE
    if bits & 2:
        return Tier.HOST
    return Tier.STORE


def slower(a: Tier, b: Tier) -> Tier:
    """The slower of two tiers: a prefix is only as fast as its slowest block."""
    order = (Tier.DEVICE, Tier.HOST, Tier.STORE)
    return a if order.index(a) >= order.index(b) else b


@dataclass(frozen=True, slots=True)
class IndexLimits:
    """Bounds every backend enforces.

    max_blocks: (instance, block) entries kept; beyond it the least recently touched are evicted.
    unconfirmed_ttl_s: lifetime of a dispatch-only (unconfirmed) entry without a confirming event.
    key_ttl_s: (Redis) a block key untouched this long expires; touches (inserts) refresh it.
    """

    max_blocks: int = 1_000_000
    unconfirmed_ttl_s: float = 30.0
    key_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_blocks <= 0 or self.unconfirmed_ttl_s <= 0 or self.key_ttl_s <= 0:
            raise ValueError("index limits must be positive")


@dataclass(frozen=True, slots=True)
class IndexStats:
    """What an index holds now and has dropped so far.

    blocks: (instance, block) entries held (Redis: members of its LRU set, trimmed on insert).
    evictions: entries dropped to stay under max_blocks, since the index was created.
    instances: instance ids holding entries.
    """

    blocks: int
    evictions: int
    instances: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """One in-process structure against its byte budget.

    entries: held now. estimated_bytes: entries x the structure's measured per-entry cost (an upper
    figure: it includes the slack of a hash table just after it grew). cap: entries allowed by the
    budget. evictions: entries dropped to stay under the cap, since the structure was made.
    """

    entries: int
    estimated_bytes: int
    cap: int
    evictions: int


def entries_within(budget_bytes: int, bytes_per_entry: int) -> int:
    """How many entries of a measured cost fit in a budget (at least one)."""
    return max(1, budget_bytes // bytes_per_entry)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Longest cached leading run of a prompt's blocks, per instance.

    blocks: instance id -> leading blocks it holds (only instances with at least one).
    tiers: instance id -> slowest tier among those blocks.
    confirmed_blocks: instance id -> leading blocks backed by events alone (no dispatch guesses).
    """

    blocks: Mapping[str, int] = field(default_factory=dict)
    tiers: Mapping[str, Tier] = field(default_factory=dict)
    confirmed_blocks: Mapping[str, int] = field(default_factory=dict)

    def cached(self, block_size: int, prompt_tokens: int | None = None) -> dict[str, CachedPrefix]:
        """As the policies want it: {instance: CachedPrefix(tokens, tier)}.

        With `prompt_tokens`, a hit is capped as vLLM caps it: at least the last token is always
        computed, so a fully cached prompt of whole blocks reuses all but its last block.
        """
        limit = None if prompt_tokens is None else max(prompt_tokens - 1, 0) // block_size
        out = {}
        for inst, n in self.blocks.items():
            usable = n if limit is None else min(n, limit)
            if usable > 0:
                out[inst] = CachedPrefix(tokens=usable * block_size, tier=self.tiers.get(inst, Tier.DEVICE))
        return out

    def best(self) -> int:
        return max(self.blocks.values(), default=0)


# One write of a batch (`apply`): (kind, tier bits, keys), applied in order.
# STORE: `keys` confirmed by an event, in the one tier `bits` names (a TIER_BITS value);
# GUESS: `keys` assumed after a dispatch (`bits` as for STORE);
# REMOVE: `keys` forgotten in the tiers of the mask `bits` (ALL_TIER_BITS: every tier);
# DROP: everything the instance holds (no keys; `bits` unused).
# Plain tuples and int kinds: the feeder builds one per event, and the Redis backends send the
# numbers as they are (their scripts decode the same ones).
STORE, GUESS, REMOVE, DROP = 0, 1, 2, 3
Write = tuple[int, int, Sequence[int]]
_ONE_TIER = frozenset(TIER_BITS.values())


def check_write(kind: int, bits: int) -> None:
    """A clear error for a write no backend knows (before anything of its batch is applied)."""
    if kind not in (STORE, GUESS, REMOVE, DROP):
        raise ValueError(f"unknown index write kind {kind!r}; expected STORE, GUESS, REMOVE or DROP")
    if kind in (STORE, GUESS) and bits not in _ONE_TIER:
        raise ValueError(f"an index insert names one tier: bits {bits!r} is not one of {sorted(_ONE_TIER)}")
    if kind == REMOVE and not 0 < bits <= ALL_TIER_BITS:
        raise ValueError(f"index removal tier mask {bits!r} out of range 1..{ALL_TIER_BITS}")


class KVIndex(Protocol):
    """Where blocks live. Keys are 64-bit ints from one `BlockKeyScheme`."""

    limits: IndexLimits

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        """Record that `instance` holds `keys` (confirmed by an event, or assumed after a dispatch)."""
        ...

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        """Forget `keys` on `instance` (in `tier` only, or in every tier when None)."""
        ...

    async def drop_instance(self, instance: str) -> None:
        """Forget everything `instance` holds (AllBlocksCleared, resync, instance gone)."""
        ...

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        """Longest leading run of `keys` per instance."""
        ...

    async def stats(self) -> IndexStats: ...

    async def close(self) -> None: ...


class BatchIndex(KVIndex, Protocol):
    """A KVIndex that takes a whole batch of writes for one instance in one call (one round trip)."""

    async def apply(self, instance: str, writes: Sequence[Write]) -> None:
        """Apply `writes` to `instance` in order, with the same result as calling insert / remove /
        drop_instance for each in turn (caps and evictions included)."""
        ...


class SingleWritesByApply:
    """insert / remove / drop_instance as one-write batches, for an index whose one write path is
    `apply` (the Redis indexes: one script for every kind of write)."""

    async def apply(self, instance: str, writes: Sequence[Write]) -> None:
        raise NotImplementedError

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        await self.apply(instance, [(STORE if confirmed else GUESS, TIER_BITS[tier], keys)])

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        await self.apply(instance, [(REMOVE, ALL_TIER_BITS if tier is None else TIER_BITS[tier], keys)])

    async def drop_instance(self, instance: str) -> None:
        await self.apply(instance, [(DROP, 0, ())])


async def apply_writes(index: KVIndex, instance: str, writes: Sequence[Write]) -> None:
    """`writes` through the index's `apply` where it has one; otherwise one call per write, in order
    (a KVIndex of another module that has only the single-write methods)."""
    apply = getattr(index, "apply", None)
    if apply is not None:
        await apply(instance, writes)
        return
    for kind, bits, keys in writes:
        check_write(kind, bits)
        if kind == DROP:
            await index.drop_instance(instance)
        elif kind == REMOVE and bits == ALL_TIER_BITS:
            await index.remove(instance, keys, tier=None)
        elif kind == REMOVE:
            for tier, bit in TIER_BITS.items():
                if bits & bit:
                    await index.remove(instance, keys, tier=tier)
        else:
            await index.insert(instance, keys, tier=tier_of_bits(bits), confirmed=kind == STORE)
