"""Real memory of a gateway-sized process holding a full KV index and full hash maps (2P+2D).

Run:  python -m tests.adapters.index.rss_full_index  [--index-bytes N] [--map-bytes N]
Prints one JSON object. The process imports what the gateway imports, builds the KV-aware analyzer
with the default (or given) budgets for two prefill and two decode instances in xxhash key mode,
then feeds every instance vLLM BlockStored events through the real feeder until its hash map is
past its cap (the index fills and evicts on the way). It reports the resident set size before and
after (VmRSS) and the peak (VmHWM), next to the budgets and what the structures hold.
tests/adapters/index/test_memory_budget.py runs it and checks the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from typing import Any


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def fill(index_bytes: int | None, map_bytes: int | None) -> dict[str, Any]:
    import conductor.server.app  # noqa: F401  # the gateway's own imports count towards its memory
    from adapters.index.feed import MAPPED_ENTRY_BYTES
    from adapters.index.memory import ENTRY_BYTES, MemoryIndex
    from adapters.kv_events import BlockStored, EventBatch
    from conductor.core.types import Role
    from conductor.kv.analyzer import KVAwareAnalyzer, build_analyzer

    rss_before = _status_mib("VmRSS")
    options: dict[str, Any] = {"enabled": True, "key_mode": "xxhash"}
    if index_bytes:
        options["index_memory_bytes"] = index_bytes
    if map_bytes:
        options["hash_map_memory_bytes_per_instance"] = map_bytes
    instances = [(f"prefill-{i}", Role.PREFILL, f"http://10.0.0.{i}:8000") for i in range(2)] + [
        (f"decode-{i}", Role.DECODE, f"http://10.0.1.{i}:8000") for i in range(2)
    ]
    analyzer = build_analyzer(options, instances)
    assert isinstance(analyzer, KVAwareAnalyzer) and isinstance(analyzer.index, MemoryIndex)
    feeder, index = analyzer.feeder, analyzer.index
    bs = analyzer.scheme.block_size
    rng = random.Random(7)
    chain = 64  # blocks per event: one request's new blocks
    target = int(feeder.max_mapped_per_instance * 1.1)
    next_hash = 1 << 40
    for name, _, _ in instances:
        parent: int | None = None
        for n in range(0, target, chain):
            hashes = tuple(range(next_hash, next_hash + chain))
            next_hash += chain
            tokens = tuple(rng.randrange(150_000) for _ in range(chain * bs))
            # every 8th event starts a new prompt, the others continue the last one
            event = BlockStored(hashes, None if n % (8 * chain) == 0 else parent, tokens, bs)
            await feeder.on_batch(name, EventBatch(0.0, (event,)))
            parent = hashes[-1]
    memory = index.memory()
    maps = feeder.map_memory()
    result = {
        "rss_before_mib": round(rss_before, 1),
        "rss_after_mib": round(_status_mib("VmRSS"), 1),
        "peak_rss_mib": round(_status_mib("VmHWM"), 1),
        "index": {
            "entries": memory.entries,
            "cap": memory.cap,
            "evictions": memory.evictions,
            "estimated_mib": round(memory.estimated_bytes / 2**20, 1),
        },
        "maps": {
            name: {
                "entries": m.entries,
                "cap": m.cap,
                "evictions": m.evictions,
                "estimated_mib": round(m.estimated_bytes / 2**20, 1),
            }
            for name, m in maps.items()
        },
        "budget_mib": round((memory.cap * ENTRY_BYTES + sum(m.cap for m in maps.values()) * MAPPED_ENTRY_BYTES) / 2**20, 1),
    }
    await analyzer.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-bytes", type=int, default=None)
    parser.add_argument("--map-bytes", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(fill(args.index_bytes, args.map_bytes))))


if __name__ == "__main__":
    main()
