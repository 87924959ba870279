"""Feeding the index: vLLM KV events (confirmed) and the gateway's own dispatches (unconfirmed).

In "vllm" key mode the gateway's keys are vLLM's event hashes, so events go in as they are. In
"xxhash" mode the gateway has its own keys and translates: a BlockStored event carries the token
ids of its blocks and the hash of the parent block, so the feeder chains its own keys from the
parent's own key (remembered per instance, bounded) over those token ids, and remembers each
vLLM hash -> own key pair for later children and BlockRemoved events.

Those maps are the gateway's second big structure (one per instance), so they are sized in bytes
(kv.hash_map_memory_bytes_per_instance) and lose their least recently stored pairs first.
A pair that ages out costs a child whose parent it was: the child is counted `unmapped` and
skipped, the same as a block stored before the gateway started listening.

The feeder also keeps per-instance evidence for the hash agreement diagnosis
(conductor/kv/agreement.py): blocks whose parent it never saw stored ("orphans": the gateway started
after the worker cached their prefix), and, in "vllm" mode, a check of the worker's own hashes: a
BlockStored at the start of a prompt carries its token ids, so the gateway hashes the first block
itself; a different hash means kv.vllm_hash_algo or kv.vllm_hash_seed is not the workers'.

A received batch costs the index one call: its events become plain writes (base.Write: store,
remove, clear), applied in order by `apply` (one script, so one Redis round trip, per batch and
instance), not one call per event. With hundreds of instances at ~100K block events/s, a call per
event was what held the feed back (the servers sat mostly idle). The exception is "vllm" mode's
parent check, which looks the parent up as the events before it left the index (see `on_batch`).

A LoRA adapter's blocks (the event names it: `lora_name`) are indexed like any others. Their vLLM
hashes include the adapter's name and path, so in "vllm" mode they go in as they are; where the
feeder rebuilds keys from an event's token ids (its own keys in "xxhash" mode, the hash check) it
keys them with the adapter as the gateway keys that adapter's prompts (conductor/core/adapter_keys.py),
the path taken from what the instance lists (`adapter_of`). An adapter whose path is not known is
skipped in "xxhash" mode and left out of the hash check. Blocks keyed on anything else beside their
tokens (multimodal inputs, a cache salt, prompt embeddings) are skipped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from adapters.index.base import DROP, REMOVE, STORE, TIER_BITS, KVIndex, MemoryUse, Write, apply_writes, entries_within
from adapters.kv_event_batch import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from conductor.core.adapter_keys import AdapterSchemes, event_adapter
from conductor.core.block_keys import BlockKeyScheme
from conductor.core.memory_budgets import DEFAULT_MAP_BUDGET_BYTES
from conductor.core.models import AdapterCard
from conductor.core.types import Tier

log = logging.getLogger(__name__)


# Bytes one vLLM hash -> own key pair costs at worst, measured with tracemalloc
# (tests/adapters/index/test_memory_budget.py measures it again): the map kept full while 3x its
# cap streamed through, caps from 20,000 to 411,000 swept finely around the hash table's resize
# points. Two 48-byte int objects (64-bit values) plus the ordered dict's slot and node: 271 to
# 333.7 bytes at the peak (tables mid-resize included), the worst just past a resize point (caps
# of ~43,600 and ~86,800); 177 on average when steady. Budgets use the worst case plus ~5%.
MAPPED_ENTRY_BYTES = 352
# DEFAULT_MAP_BUDGET_BYTES (conductor/core/memory_budgets.py): 47,662 pairs per instance


def mapped_within(budget_bytes: int) -> int:
    """The per-instance pair cap a map of `budget_bytes` gets."""
    return entries_within(budget_bytes, MAPPED_ENTRY_BYTES)


def tier_of_medium(medium: str | None) -> Tier:
    """vLLM's `medium` ("GPU" even on CPU-only builds; "CPU" for offloaded blocks) as a tier."""
    if medium is None or medium.upper() in ("GPU", "HBM", "DEVICE", "XPU", "NPU"):
        return Tier.DEVICE
    return Tier.HOST


@dataclass(frozen=True, slots=True)
class FeedStats:
    """What the feeder did with the events it saw.

    stored / removed: blocks inserted / removed from events. unmapped: blocks whose parent hash was
    unknown (xxhash mode: their own keys cannot be chained). skipped: blocks keyed on more than
    tokens and an adapter (multimodal inputs, a cache salt), blocks of an adapter whose path is not
    known (xxhash mode), or from another KV cache group. cleared: AllBlocksCleared and
    resyncs. dispatched: blocks inserted, unconfirmed, after dispatches.
    """

    stored: int
    removed: int
    unmapped: int
    skipped: int
    cleared: int
    dispatched: int


@dataclass(slots=True)
class InstanceFeed:
    """What one instance's events did (blocks), for its metrics and the agreement diagnosis.

    orphans: blocks stored under a parent the gateway never saw stored (counted for the first
    ORPHAN_CHECKS events with a parent after a (re)start, in "vllm" mode; always in "xxhash" mode,
    where they are the `unmapped` blocks). hash_checked / hash_mismatched: first blocks of prompts
    whose vLLM hash the gateway recomputed from their token ids ("vllm" mode only).
    block_size_mismatched: blocks skipped because the event's block size is not kv.block_size.
    """

    stored: int = 0
    removed: int = 0
    skipped: int = 0
    orphans: int = 0
    parent_checks: int = 0
    hash_checked: int = 0
    hash_mismatched: int = 0
    block_size_mismatched: int = 0
    cleared: int = 0
    last_mismatch: tuple[int, int] | None = field(default=None)  # (event hash, gateway hash)


class IndexFeeder:
    """Applies events and dispatches to one index with one key scheme."""

    # parents looked up in the index per instance after a (re)start ("vllm" mode): a late start
    # shows in the first events; looking up every parent would double the index traffic
    ORPHAN_CHECKS = 1024

    def __init__(
        self,
        index: KVIndex,
        scheme: BlockKeyScheme,
        *,
        translate: bool,
        max_mapped_per_instance: int = DEFAULT_MAP_BUDGET_BYTES // MAPPED_ENTRY_BYTES,
        adapter_of: Callable[[str, str], AdapterCard | None] | None = None,
    ) -> None:
        """translate: True in xxhash mode (vLLM hashes -> own keys), False when keys are vLLM's.
        adapter_of: (instance, adapter name) -> the adapter that instance lists under that name."""
        self.index = index
        self.scheme = scheme
        self.adapter_of = adapter_of
        self._adapter_schemes = AdapterSchemes(scheme)
        self.translate = translate
        self._max_mapped = max_mapped_per_instance
        self._maps: dict[str, OrderedDict[int, int]] = {}
        self._map_evictions: dict[str, int] = {}  # per instance, kept across resyncs (a counter)
        self._stored = self._removed = self._unmapped = self._skipped = self._cleared = 0
        self._dispatched = 0
        self._warned_block_size = False
        self._instances: dict[str, InstanceFeed] = {}

    def instance(self, name: str) -> InstanceFeed:
        """The live per-instance counters (created on first use)."""
        feed = self._instances.get(name)
        if feed is None:
            feed = self._instances[name] = InstanceFeed()
        return feed

    @property
    def stats(self) -> FeedStats:
        return FeedStats(self._stored, self._removed, self._unmapped, self._skipped, self._cleared, self._dispatched)

    @property
    def max_mapped_per_instance(self) -> int:
        return self._max_mapped

    def map_memory(self) -> dict[str, MemoryUse]:
        """Per instance: pairs held, their estimated bytes, the cap and evictions (for the metrics)."""
        out = {}
        for name in sorted(self._maps.keys() | self._map_evictions.keys()):
            held = len(self._maps.get(name, ()))
            out[name] = MemoryUse(held, held * MAPPED_ENTRY_BYTES, self._max_mapped, self._map_evictions.get(name, 0))
        return out

    async def on_dispatch(self, instance: str, keys: Sequence[int]) -> None:
        """The gateway sent a prompt with these block keys to `instance`'s prefill."""
        if keys:
            await self.index.insert(instance, keys, confirmed=False)
            self._dispatched += len(keys)

    async def on_resync(self, instance: str, reason: str = "") -> None:
        """Forget what `instance` holds: its event stream can no longer be trusted (or it is gone)."""
        self._forget(instance)
        await self.index.drop_instance(instance)

    def _forget(self, instance: str) -> None:
        self._cleared += 1
        feed = self.instance(instance)
        feed.cleared += 1
        feed.parent_checks = 0  # a fresh start: its first events are checked again
        self._maps.pop(instance, None)

    async def on_batch(self, instance: str, batch: EventBatch) -> None:
        """One received batch: its events become writes (base.Write), which reach the index in ONE
        call (`apply`: one round trip to Redis), in the events' order. The only exception is the
        parent check of "vllm" mode (the first ORPHAN_CHECKS parented events after a (re)start): the
        writes before it go first, so that it sees the index as the events before it left it."""
        feed = self.instance(instance)
        writes: list[Write] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                scheme = self._usable(instance, feed, event)
                if scheme is False:
                    continue
                if self.translate:
                    keys = self._own_keys(instance, feed, event, scheme)
                    if keys is not None:
                        writes.append((STORE, _medium_bit(event.medium), keys))
                    continue
                self._check_hash(feed, event, scheme)
                if event.parent_block_hash is not None and feed.parent_checks < self.ORPHAN_CHECKS:
                    await self._flush(instance, feed, writes)
                    writes = []
                    await self._check_parent(instance, feed, event)
                writes.append((STORE, _medium_bit(event.medium), event.block_hashes))
            elif isinstance(event, BlockRemoved):
                if event.group_idx not in (None, 0):
                    continue
                if self.translate:
                    mapping = self._maps.get(instance)
                    if mapping is None:
                        continue
                    removed = [k for k in map(mapping.get, event.block_hashes) if k is not None]
                    # The mapping stays: the same block may still sit in another tier, and its
                    # children (if re-stored) still need their parent's key.
                    if removed:
                        writes.append((REMOVE, _medium_bit(event.medium), removed))
                elif event.block_hashes:
                    writes.append((REMOVE, _medium_bit(event.medium), event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                self._forget(instance)
                writes.append((DROP, 0, ()))
        await self._flush(instance, feed, writes)

    async def _flush(self, instance: str, feed: InstanceFeed, writes: list[Write]) -> None:
        """The writes in one call; the blocks are counted once the index took them."""
        if not writes:
            return
        await apply_writes(self.index, instance, writes)
        stored = removed = 0
        for kind, _, keys in writes:
            if kind == STORE:
                stored += len(keys)
            elif kind == REMOVE:
                removed += len(keys)
        self._stored += stored
        feed.stored += stored
        self._removed += removed
        feed.removed += removed

    def _usable(self, instance: str, feed: InstanceFeed, ev: BlockStored) -> BlockKeyScheme | Literal[False] | None:
        """The scheme that keys the event's blocks from their token ids (None: not known here, which
        "vllm" mode can do without), or False when they are skipped (counted here)."""
        n = len(ev.block_hashes)
        if ev.group_idx not in (None, 0):
            usable, scheme = False, None
        elif not ev.lora_name and not ev.extra_keys:
            usable, scheme = True, self.scheme  # a plain prompt's blocks (what event_adapter says of them)
        else:
            usable, scheme = self._event_scheme(instance, ev)
        if not usable or (scheme is None and self.translate):
            self._skipped += n
            feed.skipped += n
            return False
        if ev.block_size != self.scheme.block_size:
            if not self._warned_block_size:
                log.warning(
                    "kv events from %s have block_size %d but the gateway keys %d-token blocks:"
                    " set kv.block_size to the workers' --block-size",
                    instance,
                    ev.block_size,
                    self.scheme.block_size,
                )
                self._warned_block_size = True
            self._skipped += n
            feed.skipped += n
            feed.block_size_mismatched += n
            return False
        return scheme

    def _own_keys(self, instance: str, feed: InstanceFeed, ev: BlockStored, scheme: BlockKeyScheme | None) -> list[int] | None:
        """The event's blocks under the gateway's own keys ("xxhash" mode), chained from the parent's
        own key (None, counted as unmapped, when the parent's pair is not known), pairs remembered."""
        n = len(ev.block_hashes)
        mapping = self._maps.get(instance)
        if mapping is None:
            mapping = self._maps[instance] = OrderedDict()
        parent: int | None = None
        if ev.parent_block_hash is not None:
            parent = mapping.get(ev.parent_block_hash)
            if parent is None:
                self._unmapped += n
                feed.orphans += n
                return None
        assert scheme is not None
        keys = scheme.extend(parent, ev.token_ids[: n * ev.block_size])
        for vllm_hash, key in zip(ev.block_hashes, keys, strict=False):
            mapping.pop(vllm_hash, None)  # a re-stored pair becomes the newest
            mapping[vllm_hash] = key
        excess = len(mapping) - self._max_mapped
        if excess > 0:
            for _ in range(excess):
                mapping.popitem(last=False)
            self._map_evictions[instance] = self._map_evictions.get(instance, 0) + excess
        return keys

    def _event_scheme(self, instance: str, ev: BlockStored) -> tuple[bool, BlockKeyScheme | None]:
        """(usable, scheme): whether the event's blocks may be indexed, and the scheme that keys
        them from their token ids (None: their adapter's path is not known here)."""
        keyable, lora = event_adapter(ev.lora_name, ev.extra_keys, ev.lora_id)
        if not keyable:
            return False, None
        if lora is None:
            return True, self.scheme
        adapter = self.adapter_of(instance, lora) if self.adapter_of is not None else None
        return True, (self._adapter_schemes.get(adapter) if adapter is not None else None)

    def _check_hash(self, feed: InstanceFeed, ev: BlockStored, scheme: BlockKeyScheme | None) -> None:
        """Evidence for the diagnosis, "vllm" mode: are the worker's hashes ours? One block's hash per
        prompt start: cheap, and enough to tell a wrong seed or algo. `scheme`: what keys the event's
        blocks (an adapter's); None: not known, no hash check."""
        size = self.scheme.block_size
        if ev.parent_block_hash is None and scheme is not None and len(ev.token_ids) >= size and ev.block_hashes:
            ours = scheme.keys(ev.token_ids[:size])[0]
            feed.hash_checked += 1
            if ours != ev.block_hashes[0]:
                feed.hash_mismatched += 1
                feed.last_mismatch = (ev.block_hashes[0], ours)

    async def _check_parent(self, instance: str, feed: InstanceFeed, ev: BlockStored) -> None:
        """Evidence for the diagnosis, "vllm" mode: is the event's parent known (confirmed) here?"""
        assert ev.parent_block_hash is not None
        feed.parent_checks += 1
        try:
            held = await self.index.match([ev.parent_block_hash])
        except Exception:  # noqa: BLE001  # evidence only: an index hiccup must not cost the insert
            return
        # confirmed only: the gateway's own dispatch of that prefix does not mean it saw it stored
        if instance not in held.confirmed_blocks:
            feed.orphans += len(ev.block_hashes)


_MEDIUM_BITS: dict[str | None, int] = {
    None: TIER_BITS[Tier.DEVICE],
    "GPU": TIER_BITS[Tier.DEVICE],
    "CPU": TIER_BITS[Tier.HOST],
}


def _medium_bit(medium: str | None) -> int:
    """tier_of_medium as the index's tier bit; the usual media without a function call per event."""
    bit = _MEDIUM_BITS.get(medium)
    return bit if bit is not None else TIER_BITS[tier_of_medium(medium)]
