"""Feeding the index: vLLM KV events (confirmed) and the gateway's own dispatches (unconfirmed).

In "vllm" key mode the gateway's keys are vLLM's event hashes, so events go in as they are. In
"xxhash" mode the gateway has its own keys and translates: a BlockStored event carries the token
ids of its blocks and the hash of the parent block, so the feeder chains its own keys from the
parent's own key (remembered per instance, bounded) over those token ids, and remembers each
vLLM hash -> own key pair for later children and BlockRemoved events.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from adapters.index.base import KVIndex
from adapters.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from conductor.core.block_keys import BlockKeyScheme
from conductor.core.types import Tier

log = logging.getLogger(__name__)


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
                 max_mapped_per_instance: int = 1_000_000) -> None:
        """translate: True in xxhash mode (vLLM hashes -> own keys), False when keys are vLLM's."""
        self.index = index
        self.scheme = scheme
        self.translate = translate
        self._max_mapped = max_mapped_per_instance
        self._maps: dict[str, OrderedDict[int, int]] = {}
        self._stored = self._removed = self._unmapped = self._skipped = self._cleared = 0
        self._dispatched = 0
        self._warned_block_size = False

    @property
    def stats(self) -> FeedStats:
        return FeedStats(self._stored, self._removed, self._unmapped, self._skipped, self._cleared,
                         self._dispatched)

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
        while len(mapping) > self._max_mapped:
            mapping.popitem(last=False)
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
