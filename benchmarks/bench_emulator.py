"""Streamed-request capacity of one emulator process.

    python benchmarks/bench_emulator.py [--clients 64] [--requests 2000] [--tokens 32] [--time-scale 0.001]

Starts one emulator subprocess (mixed role, time scale small so the profile does not dominate),
then N concurrent aiohttp clients stream `--tokens`-token completions and read every SSE chunk.
Prints requests/s and tokens/s, and the ratio to the 200 requests/s goal.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.emulator import start_emulator

GOAL_RPS = 200.0


async def client(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], todo: list[int], latencies: list[float], tokens: list[int]
) -> None:
    while todo:
        todo.pop()
        t0 = time.perf_counter()
        n = 0
        async with session.post(url, json=body) as resp:
            assert resp.status == 200, resp.status
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    n += 1
        latencies.append(time.perf_counter() - t0)
        tokens.append(n)


async def run(url: str, clients: int, requests: int, n_tokens: int) -> tuple[float, list[float], int]:
    body = {"prompt": "benchmark prompt " * 4, "max_tokens": n_tokens, "stream": True}
    todo = list(range(requests))
    latencies: list[float] = []
    tokens: list[int] = []
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as session:
        # warm up the connections
        await asyncio.gather(*(client(session, url, body, [0], [], []) for _ in range(clients)))
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session, url, body, todo, latencies, tokens) for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    assert all(t == n_tokens for t in tokens), "a stream came back short"
    return elapsed, latencies, sum(tokens)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--time-scale", type=float, default=0.001)
    args = p.parse_args()
    with start_emulator("mixed", time_scale=args.time_scale, max_num_seqs=max(args.clients, 256)) as emu:
        try:
            import uvloop
        except ImportError:
            result = asyncio.run(run(emu.url + "/v1/completions", args.clients, args.requests, args.tokens))
        else:
            result = uvloop.run(run(emu.url + "/v1/completions", args.clients, args.requests, args.tokens))
        elapsed, lat, n_tok = result
    rps = args.requests / elapsed
    print(
        f"emulator: {args.requests} streamed requests x {args.tokens} tokens, {args.clients} clients, "
        f"time scale {args.time_scale}, {os.cpu_count()} CPUs (client and server share them)"
    )
    print(f"  requests/s  {rps:8.1f}   goal {GOAL_RPS:.0f}   ratio {rps / GOAL_RPS:5.2f}x")
    print(f"  tokens/s    {n_tok / elapsed:8.0f}")
    qs = statistics.quantiles(lat, n=100)
    print(f"  latency s   p50 {qs[49]:.4f}   p99 {qs[98]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
