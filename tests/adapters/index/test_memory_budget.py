"""Memory budgets in bytes: the index and each instance's hash map hold at most what their budget
allows, evict the oldest beyond it (counted), export what they hold, and really cost no more than
the measured per-entry figures the budgets are converted with."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from adapters.index.base import IndexLimits, KVIndex
from adapters.index.feed import MAPPED_ENTRY_BYTES, IndexFeeder, mapped_within
from adapters.index.guarded import GuardedIndex
from adapters.index.memory import DEFAULT_INDEX_BUDGET_BYTES, ENTRY_BYTES, MemoryIndex, blocks_within
from adapters.kv_events import BlockStored, EventBatch
from conductor.core.block_keys import XxhashKeys
from conductor.core.types import Role, Tier
from conductor.kv.analyzer import KVAwareAnalyzer, KVAwarenessSettings, build_analyzer

ROOT = Path(__file__).resolve().parents[3]
INT64_OBJECT = 48  # sys.getsizeof(2**63) == 36, in a 48-byte pymalloc block


def distinct_keys(start: int, n: int) -> list[int]:
    return (np.arange(start, start + n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).tolist()


def stored(first_hash: int, n: int, parent: int | None, bs: int = 4) -> EventBatch:
    hashes = tuple(range(first_hash, first_hash + n))
    tokens = tuple((first_hash * 7 + i) % 50_000 for i in range(n * bs))
    return EventBatch(0.0, (BlockStored(hashes, parent, tokens, bs),))


class NullIndex:
    """Takes inserts and forgets them: measures the feeder's maps alone."""

    limits = IndexLimits()

    async def insert(self, instance: str, keys: object, *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        return None


def test_default_budgets_fit_a_2p2d_gateway_in_well_under_150_mb() -> None:
    s = KVAwarenessSettings()
    total = s.index_memory_bytes + 4 * s.hash_map_memory_bytes_per_instance
    assert total == 112 * 2**20 and s.index_memory_bytes == DEFAULT_INDEX_BUDGET_BYTES
    assert blocks_within(s.index_memory_bytes) == s.index_memory_bytes // ENTRY_BYTES
    assert mapped_within(s.hash_map_memory_bytes_per_instance) == s.hash_map_memory_bytes_per_instance // MAPPED_ENTRY_BYTES


async def test_index_past_its_budget_keeps_the_cap_and_counts_evictions() -> None:
    budget = 1 << 20
    idx = MemoryIndex(IndexLimits(max_blocks=blocks_within(budget)))
    cap = idx.limits.max_blocks
    starts = range(0, 3 * cap, 1000)
    for start in starts:
        idx.insert_sync(f"p{start // 1000 % 2}", distinct_keys(start, 1000), confirmed=True)
    use = idx.memory()
    assert use.entries == len(idx) == cap == (1 << 20) // ENTRY_BYTES
    assert use.evictions == len(starts) * 1000 - cap  # everything streamed past the cap
    assert use.estimated_bytes <= budget


async def test_hash_map_past_its_budget_keeps_the_cap_and_counts_evictions() -> None:
    feeder = IndexFeeder(
        NullIndex(),
        XxhashKeys(4),
        translate=True,  # type: ignore[arg-type]
        max_mapped_per_instance=mapped_within(100_000),
    )
    cap = feeder.max_mapped_per_instance
    parent = None
    firsts = range(10, 10 + 3 * cap, 50)
    for first in firsts:
        await feeder.on_batch("p0", stored(first, 50, parent))
        parent = first + 49
    await feeder.on_batch("p1", stored(10**9, 10, None))
    use = feeder.map_memory()
    assert use["p0"].entries == cap and use["p0"].evictions == len(firsts) * 50 - cap
    assert use["p1"].entries == 10 and use["p1"].evictions == 0
    assert feeder.stats.unmapped == 0  # the chain's newest pairs are kept, so it continues


@pytest.mark.parametrize("cap", [48_000, 100_000])
def test_index_entry_cost_is_within_the_measured_figure(cap: int) -> None:
    # 48,000: just past a resize point, the worst kind of cap when ENTRY_BYTES was measured (see
    # memory.py); 100,000: an ordinary one. The peak counts, not the end state.
    batches = [distinct_keys(s, 1000) for s in range(0, 3 * cap, 1000)]
    tracemalloc.start()
    try:
        idx = MemoryIndex(IndexLimits(max_blocks=cap))
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for i, keys in enumerate(batches):
            idx.insert_sync(f"p{i % 3}", keys, confirmed=i % 2 == 0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    per_entry = peak / cap + INT64_OBJECT  # the key objects, shared with the batches here, are the index's in life
    print(f"index, cap {cap}: {per_entry:.0f} bytes an entry at the peak (budgeted {ENTRY_BYTES})")
    assert per_entry <= ENTRY_BYTES


@pytest.mark.parametrize("cap", [43_600, 66_000])
async def test_hash_map_pair_cost_is_within_the_measured_figure(cap: int) -> None:
    # 43,600: just past a resize point, the worst kind of cap when MAPPED_ENTRY_BYTES was measured
    feeder = IndexFeeder(
        NullIndex(),
        XxhashKeys(4),
        translate=True,  # type: ignore[arg-type]
        max_mapped_per_instance=cap,
    )
    events = [stored(first, 100, None) for first in range(1 << 40, (1 << 40) + 3 * cap, 100)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for batch in events:
            await feeder.on_batch("p0", batch)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    per_pair = peak / cap + INT64_OBJECT  # the vLLM hash objects come from the events, kept alive here
    print(f"hash map, cap {cap}: {per_pair:.0f} bytes a pair at the peak (budgeted {MAPPED_ENTRY_BYTES})")
    assert per_pair <= MAPPED_ENTRY_BYTES


async def test_memory_gauges_read_back_on_the_registry() -> None:
    registry = CollectorRegistry()
    analyzer = build_analyzer(
        {
            "enabled": True,
            "block_size": 4,
            "index_memory_bytes": 1000 * ENTRY_BYTES,
            "hash_map_memory_bytes_per_instance": 300 * MAPPED_ENTRY_BYTES,
        },
        [("p0", Role.PREFILL, "http://127.0.0.1:9"), ("d0", Role.DECODE, "http://127.0.0.1:9")],
        registry,
    )
    assert isinstance(analyzer, KVAwareAnalyzer)
    try:
        parent = None
        for first in range(1, 801, 50):  # 800 blocks on each instance: 1600 index entries, cap 1000
            await analyzer.feeder.on_batch("p0", stored(first, 50, parent))
            await analyzer.feeder.on_batch("d0", stored(10**6 + first, 50, None))
            parent = first + 49

        def sample(name: str, structure: str, instance: str = "") -> float | None:
            return registry.get_sample_value(name, {"structure": structure, "instance": instance})

        assert sample("conductor_kv_memory_entries", "index") == 1000
        assert sample("conductor_kv_memory_cap_entries", "index") == 1000
        assert sample("conductor_kv_memory_evictions_total", "index") == 600
        assert sample("conductor_kv_memory_bytes", "index") == 1000 * ENTRY_BYTES
        for inst in ("p0", "d0"):
            assert sample("conductor_kv_memory_entries", "hash_map", inst) == 300
            assert sample("conductor_kv_memory_evictions_total", "hash_map", inst) == 500
            assert sample("conductor_kv_memory_bytes", "hash_map", inst) == 300 * MAPPED_ENTRY_BYTES
        text = generate_latest(registry).decode()
        assert 'conductor_kv_memory_entries{instance="p0",structure="hash_map"} 300.0' in text
    finally:
        await analyzer.close()


async def test_redis_index_reports_its_local_copy_and_guard_counters() -> None:
    registry = CollectorRegistry()
    analyzer = build_analyzer(
        {"enabled": True, "index": "redis", "redis_url": "redis://127.0.0.1:9/0", "index_memory_bytes": 500 * ENTRY_BYTES},
        [("p0", Role.PREFILL, "http://127.0.0.1:9")],
        registry,
    )
    assert isinstance(analyzer, KVAwareAnalyzer)
    index: KVIndex = analyzer.index
    assert isinstance(index, GuardedIndex)
    try:
        await index.insert("p0", distinct_keys(0, 800), confirmed=True)  # Redis is not there: local copy only
        await index.match(distinct_keys(0, 10))
        assert registry.get_sample_value("conductor_kv_memory_entries", {"structure": "index", "instance": ""}) == 500
        assert registry.get_sample_value("conductor_kv_index_missed_writes_total") == 1
        assert registry.get_sample_value("conductor_kv_index_fallback_lookups_total") == 1
        assert registry.get_sample_value("conductor_kv_index_redis_breaker_failures_total") == 2
    finally:
        await analyzer.close()


def test_a_full_index_and_full_maps_at_the_default_budgets_in_a_real_process() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.adapters.index.rss_full_index"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    print(json.dumps(report))
    assert report["index"]["entries"] == report["index"]["cap"] and report["index"]["evictions"] > 0
    assert all(m["entries"] == m["cap"] and m["evictions"] > 0 for m in report["maps"].values())
    assert len(report["maps"]) == 4
    grown = report["rss_after_mib"] - report["rss_before_mib"]
    assert grown <= report["budget_mib"]  # the budgets are a bound on what the structures really take
    assert report["peak_rss_mib"] < 300
