"""A per-instance prefix cache of full KV blocks, keyed by vLLM's own block hashes.

Semantics follow vLLM's block pool: only full blocks are cached; a request's hit is the longest run
of its leading blocks present (the chain hash makes a later block meaningless without its parents);
the hit never covers the whole prompt, because the last token must be computed to sample from;
blocks a running request holds cannot be evicted; unreferenced blocks go to an LRU free queue and a
finished request's blocks are freed tail first, so its tail is evicted before its head.
Capacity is bounded in blocks (`capacity_tokens // block_size`). A LoRA adapter's blocks are
keyed by digests that include the adapter (lora.py), so they never meet the base model's; a run
of newly cached blocks remembers the adapter for its BlockStored event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from adapters.emulator.lora import LoraAdapter
from conductor.core.vllm_hash import digest_to_event_id


@dataclass(slots=True)
class _Block:
    refs: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoredRun:
    """A run of newly cached, consecutive blocks: one vLLM BlockStored event."""

    block_hashes: tuple[int, ...]  # event ids (low 64 bits of each digest)
    parent_block_hash: int | None  # event id of the block before the run, None at the chain's start
    token_ids: tuple[int, ...]  # the run's tokens, block after block
    lora: LoraAdapter | None = None  # the adapter the request that cached them ran with


@dataclass(slots=True)
class CacheChanges:
    """What an operation did to the cache, for KV events."""

    stored: list[StoredRun] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)  # event ids of evicted blocks

    def extend(self, other: CacheChanges) -> None:
        self.stored.extend(other.stored)
        self.removed.extend(other.removed)


class PrefixCache:
    """Blocks of `block_size` tokens keyed by digest, with reference counts and LRU eviction."""

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self._blocks: dict[bytes, _Block] = {}
        # Unreferenced blocks, least recently freed first: the eviction order.
        self._free: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (vLLM's KV usage counts these, not free cached ones)."""
        return len(self._blocks) - len(self._free)

    def usage(self) -> float:
        return self.used_blocks / self.capacity_blocks

    def hit_blocks(self, digests: Sequence[bytes], prompt_tokens: int) -> int:
        """Leading blocks of the request present in cache, never covering the last prompt token."""
        limit = min(len(digests), max(prompt_tokens - 1, 0) // self.block_size)
        n = 0
        while n < limit and digests[n] in self._blocks:
            n += 1
        return n

    def acquire(self, digests: Sequence[bytes]) -> None:
        """A request starts using these cached blocks: pin them."""
        for d in digests:
            block = self._blocks[d]
            if block.refs == 0:
                self._free.pop(d, None)
            block.refs += 1

    def release(self, digests: Sequence[bytes]) -> None:
        """A request is done with these blocks; freed tail first, as vLLM frees them."""
        for d in reversed(digests):
            block = self._blocks.get(d)
            if block is None or block.refs == 0:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._free[d] = None

    def _evict_one(self, changes: CacheChanges) -> bool:
        if not self._free:
            return False
        digest, _ = self._free.popitem(last=False)
        del self._blocks[digest]
        changes.removed.append(digest_to_event_id(digest))
        return True

    def insert(
        self, digests: Sequence[bytes], token_ids: Sequence[int], start: int, lora: LoraAdapter | None = None
    ) -> tuple[int, CacheChanges]:
        """Cache (and pin) blocks `start..` of a request whose first `start` blocks it already holds
        (`lora`: the adapter it runs with, whose keys its digests include).

        Returns how many blocks from `start` on are now held, and the changes for KV events. Stops
        early when every cached block is pinned and nothing can be evicted.
        """
        changes = CacheChanges()
        size = self.block_size
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_parent: int | None = None
        held = 0

        def flush() -> None:
            nonlocal run_hashes, run_tokens
            if run_hashes:
                changes.stored.append(StoredRun(tuple(run_hashes), run_parent, tuple(run_tokens), lora))
                run_hashes, run_tokens = [], []

        for i in range(start, len(digests)):
            d = digests[i]
            if d in self._blocks:
                flush()
                self.acquire((d,))
                held += 1
                continue
            if len(self._blocks) >= self.capacity_blocks and not self._evict_one(changes):
                break
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            self._blocks[d] = _Block(refs=1, token_ids=tokens)
            if not run_hashes:
                run_parent = digest_to_event_id(digests[i - 1]) if i > 0 else None
            run_hashes.append(digest_to_event_id(d))
            run_tokens.extend(tokens)
            held += 1
        flush()
        return held, changes

    def clear(self) -> int:
        """Drop every block (vLLM's reset_prefix_cache); returns how many were dropped."""
        n = len(self._blocks)
        self._blocks.clear()
        self._free.clear()
        return n
