"""Default in-process memory budgets of the KV index, shared by its settings (conductor/config/kv.py)
and the structures they size (adapters/index/memory.py, adapters/index/feed.py), which say what one
entry costs and so how many entries a budget holds."""

from __future__ import annotations

# the in-process index (or its local copy beside Redis): 185,042 entries of adapters/index/memory.py
DEFAULT_INDEX_BUDGET_BYTES = 48 << 20
# per instance, xxhash key mode's vLLM hash -> own key map: 47,662 pairs of adapters/index/feed.py
DEFAULT_MAP_BUDGET_BYTES = 16 << 20
