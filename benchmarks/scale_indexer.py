"""bench_scale's look-ups through a `conductor indexer` over HTTP, as gateway replicas with
`kv.index: indexer` make them: the indexer in a process of its own (a server thread in the
benchmark's process would share its GIL and measure thread hand-offs), one process per instance
count, filled like the other backends (same seed, same order) straight into its index."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
from common import percentile

from adapters.index.base import IndexLimits
from conductor.core.block_keys import XxhashKeys

BLOCK = 16
PROMPT = 32768
HOLDERS = (2048, 1536, 1024, 256)  # blocks of the prompt's head held by prefill-0..3 (bench_scale's too)


def _limits() -> IndexLimits:
    from adapters.index.base import IndexLimits

    return IndexLimits(max_blocks=20_000_000)


def _serve_indexer(port: int, count: int, other_blocks: int) -> None:
    """A `conductor indexer` process holding what `lookup_latencies` builds for `count` instances
    (same seed, same order), written straight into its index (no feed connects anywhere)."""
    import uvicorn

    from conductor.config.settings import load_settings
    from conductor.indexer.api import create_indexer_app
    from conductor.indexer.service import IndexerService

    settings = load_settings(
        environ={},
        overrides={
            "block_size": BLOCK,
            "kv": {"index_memory_bytes": 8 << 30},
            "mixed": [
                {"url": f"http://127.0.0.1:9/w{i}", "name": f"prefill-{i}", "kv_events_endpoint": "tcp://*:9"}
                for i in range(count)
            ],
        },
    )
    service = IndexerService(settings)

    async def no_feeds() -> None:
        return None

    service.start = no_feeds  # type: ignore[method-assign]

    async def main() -> None:
        rng = np.random.default_rng(2)
        scheme = XxhashKeys(BLOCK)
        prompt_keys = scheme.keys(rng.integers(0, 150_000, size=PROMPT).tolist())
        for present in range(count):
            if present < len(HOLDERS):
                keys = prompt_keys[: HOLDERS[present]]
            else:
                keys = scheme.keys(rng.integers(0, 150_000, size=other_blocks * BLOCK).tolist())
            await service.index.insert(f"prefill-{present}", keys, confirmed=True)
        service.gc_freezer.freeze_now()  # as the indexer's freezer does every gc_freeze_interval_s
        config = uvicorn.Config(
            create_indexer_app(service), host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on"
        )
        await uvicorn.Server(config).serve()

    asyncio.run(main())


async def indexer_lookups(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Look-ups of a 32K-token prompt as gateway replicas make them with `kv.index: indexer`:
    IndexerClient over HTTP to a `conductor indexer` in its own process (memory index), one process
    per instance count, filled like the other backends."""
    import multiprocessing

    from common import free_port, wait_http

    from adapters.index.remote import IndexerClient

    rng = np.random.default_rng(2)
    prompt_keys = XxhashKeys(BLOCK).keys(rng.integers(0, 150_000, size=PROMPT).tolist())
    rows: dict[int, dict[str, float]] = {}
    for count in sorted(args.instances):
        port = free_port()
        proc = multiprocessing.get_context("spawn").Process(
            target=_serve_indexer, args=(port, count, args.other_blocks), daemon=True
        )
        proc.start()
        client = IndexerClient(f"http://127.0.0.1:{port}", _limits(), timeout_s=10.0, block_size=BLOCK)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
            got = await client.match(prompt_keys)
            expected = {f"prefill-{i}": n for i, n in enumerate(HOLDERS[:count])}
            if dict(got.blocks) != expected:
                raise RuntimeError(f"indexer look-up is wrong at {count} instances: {dict(got.blocks)}")
            times = []
            for _ in range(args.lookup_reps):
                t = time.perf_counter()
                await client.match(prompt_keys)
                times.append((time.perf_counter() - t) * 1e3)
            times.sort()
            rows[count] = {
                "p50_ms": percentile(times, 0.5),
                "p99_ms": percentile(times, 0.99),
                "samples": float(args.lookup_reps),
            }
        finally:
            await client.close()
            proc.terminate()
            proc.join(10)
    print("  look-ups indexer-http: done", file=sys.stderr)
    return rows
