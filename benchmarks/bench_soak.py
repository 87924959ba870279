"""Soak: an emulated 2 prefill + 2 decode cluster with KV awareness on (`kvcache_aware`, KV index
fed by the workers' events), driven near its capacity for minutes with prompts that share and
extend prefixes (so the index, the hash maps and the predictors keep growing and must evict).
Prints the gateway's RSS and open file descriptors after warm-up and at the end, the growth, and
the error count (anything but 200 and 429).

    python benchmarks/bench_soak.py [--seconds 300] [--warmup 30] [--rate 20]

Goal (issue: request path): RSS growth under 50 MB after warm-up, 0 errors, fds flat.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conductor.demo.cluster import ChildGroup, ClusterSpec, start_cluster, wait_ready

SYSTEM_PROMPTS = 64  # distinct shared prefixes (tool-agent style: long system prompt + a question)


def proc_figures(pid: int) -> tuple[float, int]:
    """(RSS in MB, open fds) of a process, from /proc."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def prompt(rng: random.Random) -> str:
    system = f"system prompt {rng.randrange(SYSTEM_PROMPTS)} " * rng.randint(40, 120)
    return system + " ".join(str(rng.randrange(10**6)) for _ in range(rng.randint(20, 200)))


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, statuses: Counter[int]) -> None:
    body = {
        "model": "soak",
        "prompt": prompt(rng),
        "max_tokens": rng.randint(8, 48),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with session.post(url, json=body) as resp:
            async for _ in resp.content.iter_any():
                pass
            statuses[resp.status] += 1
    except (aiohttp.ClientError, TimeoutError):
        statuses[-1] += 1


async def drive(url: str, rate: float, seconds: float, seed: int, statuses: Counter[int]) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=512)) as session:
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        next_at = start
        while time.monotonic() - start < seconds:
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            task = asyncio.create_task(one(session, url, rng, statuses))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0, help="measured soak after warm-up")
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (near the cluster's capacity)")
    ap.add_argument("--time-scale", type=float, default=0.25, help="emulators' modelled durations multiplied by")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="conductor-soak-") as tmp:
        group = ChildGroup(Path(tmp))
        try:
            spec = ClusterSpec(
                n_prefill=2,
                n_decode=2,
                pd_protocol="nixl",
                policy="kvcache_aware",
                model="soak",
                time_scale=args.time_scale,
                noise=0.05,
                slo_ttft_s=2.0,
                slo_tbt_s=0.1,
            )
            cluster = start_cluster(spec, group)
            wait_ready(cluster, group)
            gateway = next(c for c in group.children if c.name == "gateway")
            url = cluster.gateway_url + "/v1/completions"
            warm: Counter[int] = Counter()
            asyncio.run(drive(url, args.rate, args.warmup, 1, warm))
            rss0, fds0 = proc_figures(gateway.pid)
            statuses: Counter[int] = Counter()
            samples = []
            step = max(10.0, args.seconds / 10)
            elapsed = 0.0
            while elapsed < args.seconds:
                chunk = min(step, args.seconds - elapsed)
                asyncio.run(drive(url, args.rate, chunk, 2 + int(elapsed), statuses))
                elapsed += chunk
                samples.append((elapsed, *proc_figures(gateway.pid)))
                print(
                    f"  t={elapsed:6.0f}s  RSS {samples[-1][1]:7.1f} MB  fds {samples[-1][2]:4d}  statuses {dict(statuses)}",
                    file=sys.stderr,
                )
            rss1, fds1 = proc_figures(gateway.pid)
        finally:
            group.stop()
    errors = sum(n for s, n in statuses.items() if s not in (200, 429))
    print(
        f"\nsoak: {args.seconds:g} s at {args.rate:g} req/s after {args.warmup:g} s warm-up "
        f"(2P+2D emulators, kvcache_aware, KV index on)"
    )
    print(f"requests {sum(statuses.values())}: {dict(sorted(statuses.items()))}; errors {errors}")
    print(f"gateway RSS  after warm-up {rss0:7.1f} MB   end {rss1:7.1f} MB   growth {rss1 - rss0:+6.1f} MB (goal < 50)")
    print(f"gateway fds  after warm-up {fds0:7d}      end {fds1:7d}      growth {fds1 - fds0:+6d}")
    return 0 if errors == 0 and rss1 - rss0 < 50 else 1


if __name__ == "__main__":
    raise SystemExit(main())
