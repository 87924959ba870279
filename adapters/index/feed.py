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
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from adapters.index.base import KVIndex, MemoryUse, entries_within
from adapters.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from conductor.core.block_keys import BlockKeyScheme
from conductor.core.types import Tier

log = logging.getLogger(__name__)


# Bytes one vLLM hash -> own key pair costs at worst, measured with tracemalloc
# (tests/adapters/index/test_memory_budget.py measures it again): the map kept full while 3x its
# cap streamed through, caps from 20,000 to 411,000 swept finely around the hash table's resize
# points. Two 48-byte int objects (64-bit values) plus the ordered dict's slot and node: 271 to
# 333.7 bytes at the peak (tables mid-resize included), the worst just past a resize point (caps
# of ~43,600 and ~86,800); 177 on average when steady. Budgets use the worst case plus ~5%.
MAPPED_ENTRY_BYTES = 352
DEFAULT_MAP_BUDGET_BYTES = 16 << 20  # 47,662 pairs per instance


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
    tokens (LoRA, multimodal extras) or from another KV cache group. cleared: AllBlocksCleared and
    resyncs. dispatched: blocks inserted, unconfirmed, after dispatches.
    """

    stored: int
    removed: int
    unmapped: int
    skipped: int
    cleared: int
    dispatched: int


class IndexFeeder:
    """Applies events and dispatches to one index with one key scheme."""

    def __init__(self, index: KVIndex, scheme: BlockKeyScheme, *, translate: bool,
                 max_mapped_per_instance: int = DEFAULT_MAP_BUDGET_BYTES // MAPPED_ENTRY_BYTES) -> None:
        """translate: True in xxhash mode (vLLM hashes -> own keys), False when keys are vLLM's."""
        self.index = index
        self.scheme = scheme
        self.translate = translate
        self._max_mapped = max_mapped_per_instance
        self._maps: dict[str, OrderedDict[int, int]] = {}
        self._map_evictions: dict[str, int] = {}  # per instance, kept across resyncs (a counter)
        self._stored = self._removed = self._unmapped = self._skipped = self._cleared = 0
        self._dispatched = 0
        self._warned_block_size = False

    @property
    def stats(self) -> FeedStats:
        return FeedStats(self._stored, self._removed, self._unmapped, self._skipped, self._cleared,
                         self._dispatched)

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
        self._cleared += 1
        self._maps.pop(instance, None)
        await self.index.drop_instance(instance)

    async def on_batch(self, instance: str, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                await self._stored_event(instance, event)
            elif isinstance(event, BlockRemoved):
                await self._removed_event(instance, event)
            elif isinstance(event, AllBlocksCleared):
                await self.on_resync(instance, "AllBlocksCleared")

    async def _stored_event(self, instance: str, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if ev.group_idx not in (None, 0) or ev.lora_name or (ev.extra_keys and any(ev.extra_keys)):
            self._skipped += n
            return
        if ev.block_size != self.scheme.block_size:
            if not self._warned_block_size:
                log.warning("kv events from %s have block_size %d but the gateway keys %d-token blocks:"
                            " set kv.block_size to the workers' --block-size", instance, ev.block_size,
                            self.scheme.block_size)
                self._warned_block_size = True
            self._skipped += n
            return
        tier = tier_of_medium(ev.medium)
        if not self.translate:
            await self.index.insert(instance, ev.block_hashes, tier=tier, confirmed=True)
            self._stored += n
            return
        mapping = self._maps.setdefault(instance, OrderedDict())
        parent: int | None = None
        if ev.parent_block_hash is not None:
            parent = mapping.get(ev.parent_block_hash)
            if parent is None:
                self._unmapped += n
                return
        keys = self.scheme.extend(parent, ev.token_ids[: n * ev.block_size])
        for vllm_hash, key in zip(ev.block_hashes, keys, strict=False):
            mapping.pop(vllm_hash, None)
            mapping[vllm_hash] = key
        excess = len(mapping) - self._max_mapped
        if excess > 0:
            for _ in range(excess):
                mapping.popitem(last=False)
            self._map_evictions[instance] = self._map_evictions.get(instance, 0) + excess
        await self.index.insert(instance, keys, tier=tier, confirmed=True)
        self._stored += len(keys)

    async def _removed_event(self, instance: str, ev: BlockRemoved) -> None:
        if ev.group_idx not in (None, 0):
            return
        if self.translate:
            mapping = self._maps.get(instance)
            if mapping is None:
                return
            keys = [k for k in (mapping.get(h) for h in ev.block_hashes) if k is not None]
            # The mapping stays: the same block may still sit in another tier, and its children
            # (if re-stored) still need their parent's key.
        else:
            keys = list(ev.block_hashes)
        if keys:
            await self.index.remove(instance, keys, tier=tier_of_medium(ev.medium))
            self._removed += len(keys)
