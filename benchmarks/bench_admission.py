"""SLO admission under overload, through the real HTTP path: an emulated 2 prefill + 2 decode
cluster (time scale 1, 5% noise) behind `conductor serve --policy kvcache_aware`, driven open-loop
at a multiple of its prefill capacity. Prints how many requests were admitted, how many of those
met both SLOs, how long a 429 took to come back, and the gateway's own prediction error figures.

    python benchmarks/bench_admission.py [--load 2.0] [--seconds 20] [--slo-ttft 1.0] [--slo-tbt 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Processes, free_port, wait_http

PROMPT_TOKENS = (2048, 6144)  # uniform; the profile's prefill of 4K tokens is ~124 ms
OUTPUT_TOKENS = 32


@dataclass
class Outcome:
    status: int
    latency_s: float  # to the 429, or to the end of the stream
    ttft_s: float | None = None
    tbt_s: float | None = None
    reason: str = ""


async def one(session: aiohttp.ClientSession, url: str, prompt_len: int, rng: random.Random) -> Outcome:
    prompt = [rng.randrange(1, 250) for _ in range(prompt_len)]  # unique: nothing cached
    body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            payload = await r.json()
            return Outcome(r.status, time.perf_counter() - t0, reason=str(payload["error"].get("code")))
        first = last = None
        gaps: list[float] = []
        async for chunk in r.content.iter_any():
            now = time.perf_counter()
            n = chunk.count(b'"text"')
            if not n:
                continue
            if first is None:
                first = now
            elif last is not None:
                gaps.append((now - last) / n)
            last = now
    ttft = (first - t0) if first else None
    return Outcome(200, time.perf_counter() - t0, ttft, statistics.mean(gaps) if gaps else None)


async def drive(url: str, rate: float, seconds: float, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000)) as session:
        tasks = []
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            tasks.append(asyncio.create_task(one(session, url, rng.randint(*PROMPT_TOKENS), rng)))
            await asyncio.sleep(rng.expovariate(rate))
        for t in asyncio.as_completed(tasks):
            outcomes.append(await t)
    return outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=float, default=2.0, help="offered load as a multiple of prefill capacity")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--slo-ttft", type=float, default=1.0)
    ap.add_argument("--slo-tbt", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    with Processes() as procs:
        prefills, decodes = [], []
        for role, urls in (("prefill", prefills), ("decode", decodes)):
            for i in range(2):
                port = free_port()
                procs.python(
                    "-m",
                    "adapters.emulator",
                    "--role",
                    role,
                    "--port",
                    str(port),
                    "--model",
                    "tiny",
                    "--noise",
                    "0.05",
                    "--seed",
                    str(10 + i),
                    "--time-scale",
                    "1",
                    "--log-level",
                    "warning",
                )
                urls.append(f"http://127.0.0.1:{port}")
        for u in prefills + decodes:
            wait_http(u + "/health")
        gw_port = free_port()
        argv = [
            "-m",
            "conductor",
            "serve",
            "--port",
            str(gw_port),
            "--policy",
            "kvcache_aware",
            "--slo-ttft",
            str(args.slo_ttft),
            "--slo-tbt",
            str(args.slo_tbt),
            "--log-level",
            "warning",
        ]
        for u in prefills:
            argv += ["--prefill", u]
        for u in decodes:
            argv += ["--decode", u]
        procs.python(*argv)
        url = f"http://127.0.0.1:{gw_port}"
        wait_http(url + "/ready")
        # capacity: 2 prefill instances, each ~0.124 s for the mean 4K prompt (profile)
        capacity = 2 / 0.124
        print(
            f"prefill capacity ~{capacity:.1f} req/s; warm-up at 0.5x, then {args.load:g}x for {args.seconds:g} s",
            file=sys.stderr,
        )
        asyncio.run(drive(url + "/v1/completions", capacity * 0.5, 6.0, args.seed))  # predictors fit online
        outcomes = asyncio.run(drive(url + "/v1/completions", capacity * args.load, args.seconds, args.seed + 1))
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:  # the gateway's own error figures
            metrics = resp.read().decode()

    admitted = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status == 429]
    other = [o for o in outcomes if o.status not in (200, 429)]
    met = [
        o for o in admitted if o.ttft_s is not None and o.ttft_s <= args.slo_ttft and (o.tbt_s is None or o.tbt_s <= args.slo_tbt)
    ]
    lat429 = sorted(o.latency_s * 1000 for o in rejected)
    reasons: dict[str, int] = {}
    for o in rejected:
        reasons[o.reason] = reasons.get(o.reason, 0) + 1
    print(f"\noffered {len(outcomes)} requests at {args.load:g}x capacity over {args.seconds:g} s")
    print(f"admitted {len(admitted)}, rejected 429: {len(rejected)} {reasons}, other errors: {len(other)}")
    if admitted:
        ttfts = sorted(o.ttft_s for o in admitted if o.ttft_s is not None)
        print(
            f"admitted meeting both SLOs (TTFT <= {args.slo_ttft} s, TBT <= {args.slo_tbt} s): "
            f"{len(met)}/{len(admitted)} = {len(met) / len(admitted):.1%}"
        )
        print(f"admitted TTFT p50 {statistics.median(ttfts):.3f} s, p99 {ttfts[int(len(ttfts) * 0.99) - 1]:.3f} s")
    if lat429:
        print(
            f"429 latency at the client: p50 {statistics.median(lat429):.2f} ms, "
            f"p99 {lat429[max(0, int(len(lat429) * 0.99) - 1)]:.2f} ms"
        )
    print("gateway's prediction error over its recent window (MAPE / p90 coverage):")
    figures: dict[tuple[str, str], dict[str, str]] = {}
    for line in metrics.splitlines():
        if line.startswith("conductor_prediction_") and "{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            figures.setdefault((labels, ""), {})[name.removeprefix("conductor_prediction_")] = value
    for (labels, _), v in sorted(figures.items()):
        print(
            f"  {labels:55s} n={float(v.get('samples', 0)):5.0f}  MAPE {float(v.get('mape', 0)):6.1%}  "
            f"coverage {float(v.get('p90_coverage', 0)):.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
