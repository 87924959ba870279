"""Measured growth: how far one indexer and one gateway's hot path scale. `python benchmarks/bench_scale.py`.

One table (about 3 minutes on a 2-core machine; `--quick` about 30 s):
- ingest: vLLM KV-event batches (msgpack, encoded as the emulator and vLLM encode them) decoded and
  applied by `IndexFeeder.on_batch`, one asyncio task per publishing instance as the gateway and the
  indexer run them, into the memory index, a single-node Redis and (when the code exists) a Redis
  Cluster; block events = stored + removed blocks, per second of wall time. Each instance behaves
  like a prefill engine with chunked prefill: a batch per step, ~512 new blocks spread over 1-4
  requests, chained by parent hash, and once its cache is full the same number of its oldest blocks
  removed (the steady state, which doubles the events per computed block).
- memory per block: the memory index's traced bytes per entry (tracemalloc, index kept, keys' int
  objects counted) beside its budget figure ENTRY_BYTES; Redis: used_memory delta / entries held.
- look-up: `match` of a 32K-token prompt (2,048 blocks of 16) with 16..1,024 prefill instances
  present: four hold its head (2,048 / 1,536 / 1,024 / 256 blocks), the rest other prompts; per
  backend, and through a `conductor indexer` over HTTP as a replica with `kv.index: indexer` asks it.
- decision: `decide` of kvcache_aware (and round_robin for reference) on N instances = N/2 prefill
  + N/2 decode, with the queues and streams of benchmarks/bench_decision.py.
- paper calculation: what 1,000 H100-class prefill instances emit, from the bundled Qwen3-8B/H800
  profile, against the measured ingest rates.
Each goal is printed with its measured value and PASS/MISS; `--json FILE` writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decision import measure, scaled_cases
from common import PrivateRedis, event_payloads, percentile, redis_used_memory
from scale_indexer import BLOCK, HOLDERS, PROMPT, indexer_lookups

from adapters.index.base import IndexLimits, KVIndex
from adapters.index.feed import MAPPED_ENTRY_BYTES, IndexFeeder
from adapters.index.memory import ENTRY_BYTES, MemoryIndex
from adapters.index.redis import RedisIndex
from adapters.kv_events import decode_batch
from conductor.core.block_keys import XxhashKeys
from conductor.core.profile import Profile

GOALS = {"ingest_memory": 200_000.0, "ingest_cluster": 100_000.0, "lookup_p99_ms": 5.0, "decision_p99_ms": 2.0}
IndexFactory = Callable[[], Awaitable[tuple[KVIndex, Callable[[], Awaitable[None]]]]]


@dataclass
class Report:
    """Every figure, for the table and the JSON."""

    ingest: dict[str, dict[str, float]] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    lookup: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    decision: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    paper: dict[str, float] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    goals: list[dict[str, Any]] = field(default_factory=list)


async def ingest_rate(index: KVIndex, payloads: dict[str, list[bytes]], *, translate: bool) -> tuple[float, int]:
    """Block events per second through decode + feeder + index; one task per instance, as subscribers run."""
    feeder = IndexFeeder(index, XxhashKeys(BLOCK), translate=translate)

    async def one(instance: str, batches: list[bytes]) -> None:
        for payload in batches:
            await feeder.on_batch(instance, decode_batch(payload))

    start = time.perf_counter()
    await asyncio.gather(*(one(name, batches) for name, batches in payloads.items()))
    elapsed = time.perf_counter() - start
    stats = feeder.stats
    if stats.unmapped or stats.skipped:
        raise RuntimeError(f"the workload is not what the feeder expects: {stats}")
    events = stats.stored + stats.removed
    return events / elapsed, events


# ---- memory per block ------------------------------------------------------------------------


def memory_index_bytes_per_entry(entries: int, instances: int = 16) -> float:
    """Traced bytes of a filled MemoryIndex per entry, the keys' int objects included."""
    rng = random.Random(1)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = MemoryIndex(IndexLimits(max_blocks=entries * 2))
        for i in range(instances):
            keys = [rng.getrandbits(64) | (1 << 63) for _ in range(entries // instances)]
            index.insert_sync(f"prefill-{i}", keys, confirmed=True)
            del keys
        used = tracemalloc.get_traced_memory()[0] - base
        return used / len(index)
    finally:
        tracemalloc.stop()


# ---- look-ups --------------------------------------------------------------------------------


async def lookup_latencies(
    index: KVIndex, counts: list[int], *, other_blocks: int, reps: int, seed: int = 2
) -> dict[int, dict[str, float]]:
    """match() of one 32K-token prompt as instances are added; p50/p99 ms at each count."""
    rng = np.random.default_rng(seed)
    scheme = XxhashKeys(BLOCK)
    prompt_keys = scheme.keys(rng.integers(0, 150_000, size=PROMPT).tolist())
    present = 0
    out: dict[int, dict[str, float]] = {}
    for count in sorted(counts):
        while present < count:
            name = f"prefill-{present}"
            if present < len(HOLDERS):
                await index.insert(name, prompt_keys[: HOLDERS[present]], confirmed=True)
            else:  # another prompt's blocks: its first key is not this prompt's
                await index.insert(
                    name, scheme.keys(rng.integers(0, 150_000, size=other_blocks * BLOCK).tolist()), confirmed=True
                )
            present += 1
        got = await index.match(prompt_keys)
        expected = {f"prefill-{i}": n for i, n in enumerate(HOLDERS[:count])}
        if dict(got.blocks) != expected:
            raise RuntimeError(f"look-up is wrong at {count} instances: {dict(got.blocks)}")
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            await index.match(prompt_keys)
            times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        out[count] = {"p50_ms": percentile(times, 0.5), "p99_ms": percentile(times, 0.99), "samples": float(reps)}
    return out


# ---- decisions -------------------------------------------------------------------------------


def decision_latencies(counts: list[int], budget: int) -> dict[str, dict[int, dict[str, float]]]:
    """Thread-CPU p50/p99 ms per decision (wall time on a shared box mostly measures preemption)."""
    out: dict[str, dict[int, dict[str, float]]] = {"kvcache_aware": {}, "round_robin": {}}
    for count in counts:
        n = max(100, min(2000, budget // count))
        cases = scaled_cases(count, n + 200)  # measure() warms up on the first 200
        runs: list[tuple[str, dict[str, object]]] = [("kvcache_aware", {"online": False}), ("round_robin", {})]
        for name, options in runs:
            wall, cpu = measure(name, options, cases)
            out[name][count] = {
                "p50_ms": percentile(cpu, 0.5) / 1e3,
                "p99_ms": percentile(cpu, 0.99) / 1e3,
                "wall_p99_ms": percentile(wall, 0.99) / 1e3,
                "samples": float(len(cpu)),
            }
    return out


# ---- the paper calculation -------------------------------------------------------------------


def paper_calculation(ingest: dict[str, dict[str, float]], instances: int = 1000, chunk_tokens: int = 8192) -> dict[str, float]:
    """Blocks per second 1,000 prefill instances emit at full prefill throughput, against one indexer.

    Throughput from the bundled Qwen3-8B/H800 profile (H800 = H100 compute): a cold 8K-token
    prefill takes T_prefill(8192, 0). A small model is the worst case (most tokens per second per
    GPU). Every computed block is stored once and, with the cache full, one old block is removed
    for it: two block events per 16 tokens. Cache hits compute (and announce) nothing, so a cold
    fleet is the upper bound."""
    profile = Profile()
    tokens_s = chunk_tokens / profile.prefill_s(chunk_tokens, 0)
    stored_s = tokens_s / BLOCK
    fleet = instances * stored_s * 2
    out = {
        "instances": float(instances),
        "tokens_per_s_per_instance": tokens_s,
        "stored_blocks_per_s_per_instance": stored_s,
        "block_events_per_s_fleet": fleet,
    }
    for backend, row in ingest.items():
        out[f"indexers_needed_{backend}"] = fleet / row["block_events_per_s"]
    return out


# ---- backends --------------------------------------------------------------------------------


def _limits() -> IndexLimits:
    return IndexLimits(max_blocks=20_000_000)


async def _memory() -> tuple[KVIndex, Callable[[], Awaitable[None]]]:
    index = MemoryIndex(_limits())
    return index, index.close


def _redis_factory(url: str) -> IndexFactory:
    async def make() -> tuple[KVIndex, Callable[[], Awaitable[None]]]:
        index = RedisIndex(
            url, prefix=f"bench:scale:{uuid.uuid4().hex[:8]}:", limits=_limits(), timeout_s=10.0, write_timeout_s=10.0
        )

        async def done() -> None:
            await index.clear()
            await index.close()

        return index, done

    return make


async def run_backend(
    report: Report,
    label: str,
    factory: IndexFactory,
    args: argparse.Namespace,
    payloads: dict[str, list[bytes]],
    used_memory: Callable[[], int] | None,
) -> None:
    """Ingest (both key modes), then look-ups on a fresh index, and (servers) memory per entry held."""
    for translate in (True, False):
        index, done = await factory()
        try:
            rate, events = await ingest_rate(index, payloads, translate=translate)
        finally:
            await done()
        key = f"{label}" if translate else f"{label}[vllm keys]"
        report.ingest[key] = {"block_events_per_s": rate, "block_events": float(events)}
        print(f"  ingest {key}: {rate:,.0f} block events/s ({events:,} events)", file=sys.stderr)
    index, done = await factory()
    try:
        before = used_memory() if used_memory else 0
        report.lookup[label] = await lookup_latencies(
            index, args.instances, other_blocks=args.other_blocks, reps=args.lookup_reps
        )
        if used_memory:
            entries = (await index.stats()).blocks
            report.memory[label] = {"bytes_per_block": (used_memory() - before) / entries, "entries": float(entries)}
    finally:
        await done()
    print(f"  look-ups {label}: done", file=sys.stderr)


async def run_cluster(report: Report, args: argparse.Namespace, payloads: dict[str, list[bytes]]) -> None:
    """The same on a six-node Redis Cluster (3 masters + 3 replicas) started for the run."""
    try:
        from adapters.index.redis_cluster import RedisClusterIndex
        from tests.support.redis_cluster import missing_cluster_tools, start_redis_cluster
    except ImportError as exc:
        report.unavailable["redis-cluster"] = f"not available: {exc}"
        return
    reason = missing_cluster_tools()
    if reason is not None:
        report.unavailable["redis-cluster"] = f"not available: {reason}"
        return
    cluster = start_redis_cluster()
    try:

        async def make() -> tuple[KVIndex, Callable[[], Awaitable[None]]]:
            index = RedisClusterIndex(
                cluster.urls,
                prefix=f"bench:scale:{uuid.uuid4().hex[:8]}:",
                limits=_limits(),
                timeout_s=10.0,
                write_timeout_s=10.0,
            )

            async def done() -> None:
                await index.clear()
                await index.close()

            return index, done

        def used_memory() -> int:  # the masters' (one copy of the data; replicas hold another)
            return sum(redis_used_memory(f"redis://127.0.0.1:{port}/0") for port in cluster.masters())

        await run_backend(report, "redis-cluster", make, args, payloads, used_memory)
    finally:
        cluster.stop()


async def run_all(args: argparse.Namespace) -> Report:
    report = Report()
    t0 = time.perf_counter()
    # caches fill halfway through, so the second half runs in the steady state (a removal per store)
    payloads, _ = event_payloads(args.publishers, args.batches, cache_blocks=args.batches * 512 // 2)
    print(
        f"workload: {args.publishers} instances x {args.batches} batches built in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    entries = memory_index_bytes_per_entry(args.memory_entries)
    report.memory["memory"] = {
        "bytes_per_block": entries,
        "budget_bytes_per_block": float(ENTRY_BYTES),
        "hash_map_bytes_per_block": float(MAPPED_ENTRY_BYTES),
    }
    await run_backend(report, "memory", _memory, args, payloads, None)
    if args.redis_url == "private":
        with PrivateRedis() as server:
            await run_backend(report, "redis", _redis_factory(server.url), args, payloads, lambda: redis_used_memory(server.url))
    elif args.redis_url:
        await run_backend(
            report, "redis", _redis_factory(args.redis_url), args, payloads, lambda: redis_used_memory(args.redis_url)
        )
    else:
        report.unavailable["redis"] = "skipped (--redis-url '')"
    if args.cluster:
        await run_cluster(report, args, payloads)
    else:
        report.unavailable["redis-cluster"] = "skipped (--no-cluster)"
    report.lookup["indexer-http"] = await indexer_lookups(args)
    report.decision = decision_latencies(args.instances, args.decision_budget)
    report.paper = paper_calculation({k: v for k, v in report.ingest.items() if "[" not in k})
    report.goals = judge(report, args)
    return report


# ---- verdicts and the table ------------------------------------------------------------------


def judge(report: Report, args: argparse.Namespace) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []

    def add(name: str, measured: float | None, goal: float, higher_is_better: bool, unit: str) -> None:
        if measured is None:
            goals.append({"goal": name, "target": goal, "measured": None, "unit": unit, "verdict": "N/A"})
            return
        ok = measured >= goal if higher_is_better else measured <= goal
        goals.append({"goal": name, "target": goal, "measured": measured, "unit": unit, "verdict": "PASS" if ok else "MISS"})

    def rate(key: str) -> float | None:
        row = report.ingest.get(key)
        return row["block_events_per_s"] if row else None

    add("ingest into memory >= 200,000 block events/s", rate("memory"), GOALS["ingest_memory"], True, "/s")
    add("ingest into Redis Cluster >= 100,000 block events/s", rate("redis-cluster"), GOALS["ingest_cluster"], True, "/s")
    top = max(args.instances)
    for backend, rows in report.lookup.items():
        add(
            f"look-up p99 <= 5 ms, 32K tokens, {top} instances ({backend})",
            rows[top]["p99_ms"] if top in rows else None,
            GOALS["lookup_p99_ms"],
            False,
            "ms",
        )
    mid = 256 if 256 in args.instances else None
    kv = report.decision["kvcache_aware"].get(mid) if mid else None
    add(
        "kvcache_aware decision p99 <= 2 ms at 256 instances", kv["p99_ms"] if kv else None, GOALS["decision_p99_ms"], False, "ms"
    )
    return goals


def print_table(report: Report, args: argparse.Namespace) -> None:
    counts = sorted(args.instances)
    print(f"\n{'figure':<52}" + "".join(f"{c:>12}" for c in counts))
    print("-" * (52 + 12 * len(counts)))
    for key, row in report.ingest.items():
        print(f"{'ingest ' + key + ' (block events/s)':<52}{row['block_events_per_s']:>12,.0f}")
    for name, why in report.unavailable.items():
        print(f"{'ingest / look-up ' + name:<52}  {why}")
    for key, row in report.memory.items():
        extra = ""
        if "budget_bytes_per_block" in row:
            extra = (
                f"   (budget figure {row['budget_bytes_per_block']:.0f};"
                f" xxhash mode adds a map pair of {row['hash_map_bytes_per_block']:.0f} per mapped block)"
            )
        print(f"{'index memory per block, ' + key + ' (bytes)':<52}{row['bytes_per_block']:>12.1f}{extra}")
    for backend, rows in report.lookup.items():
        for q in ("p50_ms", "p99_ms"):
            label = f"look-up 32K tokens {backend} {q[:3]} (ms)"
            print(f"{label:<52}" + "".join(f"{rows[c][q]:>12.3f}" if c in rows else f"{'-':>12}" for c in counts))
    for policy, rows in report.decision.items():
        for q in ("p50_ms", "p99_ms"):
            label = f"decision {policy} {q[:3]} (ms CPU, N/2 P + N/2 D)"
            print(f"{label:<52}" + "".join(f"{rows[c][q]:>12.3f}" for c in counts))
    p = report.paper
    print(
        f"\npaper: {p['instances']:,.0f} prefill instances, Qwen3-8B on H800 (= H100 compute; the bundled profile),"
        f" a cold {8192}-token prefill each:"
    )
    print(
        f"  {p['tokens_per_s_per_instance']:,.0f} tokens/s per instance = {p['stored_blocks_per_s_per_instance']:,.0f}"
        f" blocks/s stored (block size {BLOCK}), x2 with removals once caches are full"
    )
    print(f"  fleet: {p['block_events_per_s_fleet']:,.0f} block events/s, the worst case (a small model, no cache hits)")
    for key, value in p.items():
        if key.startswith("indexers_needed_"):
            print(f"  indexers needed at the measured {key.removeprefix('indexers_needed_')} ingest rate: {value:.1f}")
    print("\ngoals:")
    for g in report.goals:
        shown = (
            "n/a"
            if g["measured"] is None
            else (f"{g['measured']:,.0f}{g['unit']}" if g["unit"] == "/s" else f"{g['measured']:.3f} {g['unit']}")
        )
        print(f"  {g['verdict']:<5} {g['goal']:<66} measured {shown}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~30 s run: fewer batches, samples and instances' blocks")
    ap.add_argument(
        "--instances",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16, 64, 256, 1024],
        help="instance counts for look-ups and decisions, comma-separated",
    )
    ap.add_argument(
        "--redis-url",
        default="private",
        help="'private' starts a redis-server of its own on a free port; a URL uses that server; '' skips",
    )
    ap.add_argument("--no-cluster", dest="cluster", action="store_false", help="skip the Redis Cluster rows")
    ap.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="write every figure as JSON")
    args = ap.parse_args()
    args.publishers = 16
    args.batches = 12 if args.quick else 60
    args.other_blocks = 64 if args.quick else 256
    args.lookup_reps = 100 if args.quick else 400
    args.decision_budget = 40_000 if args.quick else 400_000
    args.memory_entries = 100_000 if args.quick else 400_000
    report = asyncio.run(run_all(args))
    print_table(report, args)
    if args.json_out:
        doc = {
            "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
            "goals": report.goals,
            "ingest": report.ingest,
            "memory": report.memory,
            "lookup": report.lookup,
            "decision": report.decision,
            "paper": report.paper,
            "unavailable": report.unavailable,
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
