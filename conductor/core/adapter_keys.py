"""Block keys of a LoRA adapter's prompts, and which adapter a KV event's blocks were keyed with.

vLLM hashes `(("lora", name, path),)` into every block of a request that uses an adapter, as the
block's extra keys (vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`): an adapter's
blocks never share a hash with the base model's, another adapter's, or the same name re-pointed at
another path. Its KV events say `lora_name` and, per block, the extra keys untagged (`[name]`,
`to_event_extra_keys`), never the path: whoever rebuilds keys from an event's token ids learns the
path from what the engine lists (`AdapterCard.path`, its /v1/models card's `root`).

- "vllm" key mode: an adapter's keys are `VllmKeys` with those extra keys, equal to the hashes
  the engine computes and publishes.
- "xxhash" mode: the chain's seed is the configured seed with the adapter's name and path folded
  in (`adapter_seed`): the same separation, at no cost per block.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

from conductor.core.block_keys import BlockKeyScheme, VllmKeys, XxhashKeys
from conductor.core.models import AdapterCard, lora_extra_keys

__all__ = ["AdapterSchemes", "adapter_seed", "event_adapter", "scheme_for_adapter"]

_MASK64 = (1 << 64) - 1


def adapter_seed(seed: int, adapter: AdapterCard) -> int:
    """The xxhash chain's seed for `adapter`'s prompts: `seed` with its name and path folded in.
    Each part is length-prefixed, so no name/path split of the same bytes gives the same seed."""
    name, path = adapter.name.encode(), adapter.path.encode()
    data = b"lora:%d:%s:%d:%s" % (len(name), name, len(path), path)
    return xxhash.xxh3_64_intdigest(data, seed & _MASK64)


def scheme_for_adapter(scheme: BlockKeyScheme, adapter: AdapterCard | None) -> BlockKeyScheme | None:
    """The keys of prompts run with `adapter` (None: the base model, `scheme` itself); None when
    `scheme` is of a kind that cannot tell adapters apart (its keys would be the base model's)."""
    if adapter is None:
        return scheme
    if isinstance(scheme, XxhashKeys):
        return XxhashKeys(scheme.block_size, adapter_seed(scheme.seed, adapter))
    if isinstance(scheme, VllmKeys):
        return scheme.with_extra_keys(lora_extra_keys(adapter))
    return None


class AdapterSchemes:
    """`scheme_for_adapter` remembered per adapter: a vLLM scheme is built once, not per request.
    Bounded: past `max_entries` adapters (name and path pairs) it starts over."""

    def __init__(self, scheme: BlockKeyScheme, max_entries: int = 1024) -> None:
        self.scheme = scheme
        self.max_entries = max_entries
        self._schemes: dict[AdapterCard, BlockKeyScheme | None] = {}

    def get(self, adapter: AdapterCard | None) -> BlockKeyScheme | None:
        if adapter is None:
            return self.scheme
        # the base model a card names plays no part in the hash: cards differing only there share
        key = AdapterCard(adapter.name, "", adapter.path)
        try:
            return self._schemes[key]
        except KeyError:
            pass
        if len(self._schemes) >= self.max_entries:
            self._schemes.clear()
        found = self._schemes[key] = scheme_for_adapter(self.scheme, key)
        return found


def _one_name(entry: Any) -> str | None:
    """The name in an event's per-block extra keys entry `[name]`; None for any other shape."""
    if isinstance(entry, list | tuple) and len(entry) == 1 and isinstance(entry[0], str):
        return entry[0]
    return None


def event_adapter(lora_name: str | None, extra_keys: Sequence[Any] | None, lora_id: int | None = None) -> tuple[bool, str | None]:
    """(keyable, adapter name) of a BlockStored's blocks: keyable when their hashes took no more
    than their tokens and at most one adapter (no multimodal input, cache salt nor prompt
    embeddings: those come as further entries in a block's extra keys, and are never rebuilt here).

    The name is the event's `lora_name`; an engine that sends only the deprecated `lora_id` has it
    as the one value of each block's extra keys."""
    entries = [e for e in (extra_keys or ()) if e]  # None or empty: that block hashed no extra key
    name = lora_name or None
    if name is None and lora_id and entries:
        name = _one_name(entries[0])
    if name is None:
        return (not entries), None
    return all(_one_name(e) == name for e in entries), name
