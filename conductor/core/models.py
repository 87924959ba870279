"""What a worker serves: base models and the LoRA adapters loaded on top of them.

A vLLM engine lists both in its `/v1/models`: a base model's card has no `parent` (or names
itself); an adapter's card has `parent` = the base model and `root` = the adapter's path, the
path vLLM mixes into every block hash of a request that uses it (`("lora", name, path)` extra keys,
vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`). A request names an adapter in its
`model` field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AdapterCard", "adapter_of_card", "lora_extra_keys"]


@dataclass(frozen=True, slots=True)
class AdapterCard:
    """A LoRA adapter as an engine lists it: its served name, the base model, the adapter's path."""

    name: str
    base: str
    path: str


def adapter_of_card(card: Mapping[str, Any]) -> AdapterCard | None:
    """The adapter a `/v1/models` card describes; None for a base model's card or a malformed one."""
    name, parent, root = card.get("id"), card.get("parent"), card.get("root")
    if not isinstance(name, str) or not isinstance(parent, str) or not parent or parent == name:
        return None
    return AdapterCard(name, parent, root if isinstance(root, str) else "")


def lora_extra_keys(adapter: AdapterCard | None) -> tuple[tuple[str, str, str], ...] | None:
    """The extra keys vLLM hashes into every block of a request that uses `adapter` (None: none)."""
    return None if adapter is None else (("lora", adapter.name, adapter.path),)
