"""Issues 5 and 39: the KVCache-aware policy's TTFT and TBT predictions, measured by the gateway itself
on wall-clock times against emulated workers whose timing the predictors do not start from.

    python benchmarks/bench_prediction_accuracy.py                     # P/D and mixed, mismatched + effects, 4 seeds
    python benchmarks/bench_prediction_accuracy.py --scenario mixed --seeds 1   # one run (~2.5 min)
    python benchmarks/bench_prediction_accuracy.py --scenario pd --matched --no-effects   # the old, by-construction setup
    python benchmarks/bench_prediction_accuracy.py --engines vllm --scenario mixed   # real vLLM CPU engines

With `--engines vllm` the workers are real vLLM CPU engines serving tests/e2e_vllm's tiny model
(benchmarks/prediction_vllm.py: unique and shared-prefix prompts, each warmed up and measured; the
target there is the TTFT bound's coverage, 0.85-0.95, MAPE reported).

Wall-clock figures need an idle machine (on a loaded one the workers' steps stretch and the
predictions chase them), so this is a benchmark; tests/conductor/routing/test_prediction_accuracy.py checks
what holds on any machine. Exits 1 when a target is missed.

The workers (8% lognormal noise, time scale 0.5) run `conductor/data/profiles/qwen3-8b-a100-roofline.yaml`
(another GPU's timing: prefill per token x4.8, attention x51, fixed cost x0.33 of the bundled H800
fit, decode and transfer coefficients changed apart) with the timing effects the predictors' formula
lacks (adapters/emulator/effects.py): chunked prefill with a 2,048-token budget, decodes 50% slower
in a step shared with a prefill chunk, steps up to 2x slower as KV usage goes from 25% to 100% of a
32K-token cache. The gateway starts from the bundled H800 profile and learns online.
Scenarios: `pd` (2 prefill + 2 decode, nixl) and `mixed` (2 mixed workers: prefills and decodes share
an engine). Open-loop Poisson arrivals at about 65% of prefill capacity, prompts of 1K-6K tokens
(unique: nothing cached), 16-64 output tokens. After a warm-up the gateway's error windows are
restarted; the next requests are measured and the gateway's own exported figures
(`conductor_prediction_mape` / `_p90_coverage` / `_samples` on /metrics) are read back. Each
scenario runs `--seeds` times (default 4), each seed drawing other worker noise, arrivals and
prompts; the targets are judged on the median over the seeds, printed with the min..max (one
seed's mixed TTFT MAPE has read from 8.5% to 14.4%).

Targets: TTFT MAPE <= 10%; p90 coverage 0.90 with a tolerance of +-0.05: over ~300 requests the
binomial standard deviation of an exact 0.9 coverage is 0.017, and the bound itself is a quantile
estimated from a 256-request window, which adds about as much again; 0.05 is about two of the
combined deviations -- a 0.7 (too tight) or 1.0 (too loose) bound fails. TBT MAPE and coverage
(`tbt_at_decision`: the TBT predicted at the decision against the stream's mean) are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from conductor.server.app import create_app
from tests.support.emulator import start_emulator
from tests.support.servers import serve

TIME_SCALE = 0.5
NOISE = 0.08
PROMPT = (1024, 6144)
OUTPUT = (16, 64)
MISMATCHED = Path(__file__).resolve().parents[1] / "conductor/data/profiles/qwen3-8b-a100-roofline.yaml"
# (adapters/emulator/effects.py) chunked prefill, mixed-batch interference, KV pressure on a small cache
EFFECTS = {
    "max_num_batched_tokens": 2048,
    "mixed_batch_overhead": 0.5,
    "kv_capacity_tokens": 32768,
    "kv_pressure_threshold": 0.25,
    "kv_pressure_slowdown": 1.0,
}
# req/s at ~65% of prefill capacity: 2 prefills of the mean 3.6K prompt at time scale 0.5 take
# ~0.06 s each on the bundled profile, ~0.2 s on the A100 one; a mixed engine also runs the decodes
RATES = {("pd", False): 22.0, ("pd", True): 6.5, ("mixed", False): 14.0, ("mixed", True): 4.5}
WARMUP, MEASURED = 150, 300
_METRIC = re.compile(r'^conductor_prediction_(mape|p90_coverage|samples)\{component="([^"]+)",instance="([^"]+)"\} (\S+)$')


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> int:
    prompt = [rng.randrange(1, 250) for _ in range(rng.randint(*PROMPT))]  # unique: nothing cached
    body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(*OUTPUT), "stream": True, "ignore_eos": True}
    async with session.post(url, json=body) as r:
        async for _ in r.content.iter_any():
            pass
        return r.status


async def _drive(url: str, n: int, seed: int, rate: float) -> list[int]:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=500)) as session:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(_one(session, url, rng)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def _exported(metrics: str) -> dict[tuple[str, str], dict[str, float]]:
    out: dict[tuple[str, str], dict[str, float]] = {}
    for line in metrics.splitlines():
        m = _METRIC.match(line)
        if m:
            out.setdefault((m.group(2), m.group(3)), {})[m.group(1)] = float(m.group(4))
    return out


def _pooled(stats: dict[tuple[str, str], dict[str, float]], component: str) -> tuple[int, float, float]:
    rows = [v for (c, _), v in stats.items() if c == component]
    n = sum(int(v["samples"]) for v in rows)
    mape = sum(v["mape"] * v["samples"] for v in rows) / n
    cover = sum(v["p90_coverage"] * v["samples"] for v in rows) / n
    return n, mape, cover


def _settings(urls: dict[str, list[str]]) -> object:
    overrides: dict[str, object] = {role: [{"url": u} for u in us] for role, us in urls.items()}
    overrides.update({"policy": "kvcache_aware", "logs": {"level": "warning"}})
    return load_settings(environ={}, overrides=overrides)


def run(scenario: str, mismatched: bool, effects: bool, rate: float | None, seed: int = 0) -> dict[str, tuple[int, float, float]]:
    """One scenario end to end; pooled (samples, MAPE, p90 coverage) per exported component. `seed`
    k > 0 draws other workers' noise and other arrivals and prompts (seed 0: the original run)."""
    opts: dict[str, Any] = {"noise": NOISE, "time_scale": TIME_SCALE, "log_level": "warning"}
    if mismatched:
        opts["profile"] = str(MISMATCHED)
    if effects:
        opts.update(EFFECTS)
    rate = rate or RATES[(scenario, mismatched)]
    with ExitStack() as stack:

        def emu(role: str, worker: int) -> str:
            return stack.enter_context(start_emulator(role, model="tiny", seed=worker + 10 * seed, **opts)).url

        if scenario == "pd":
            urls = {"prefill": [emu("prefill", 1), emu("prefill", 2)], "decode": [emu("decode", 3), emu("decode", 4)]}
        else:
            urls = {"mixed": [emu("mixed", 1), emu("mixed", 2)]}
        gateway = Gateway(_settings(urls))  # type: ignore[arg-type]
        url = stack.enter_context(serve(create_app(gateway))).url
        statuses = asyncio.run(_drive(url + "/v1/completions", WARMUP, 11 + 100 * seed, rate))
        gateway.policy.predictors.reset_errors()  # type: ignore[attr-defined]
        statuses += asyncio.run(_drive(url + "/v1/completions", MEASURED, 12 + 100 * seed, rate))
        stats = _exported(httpx.get(url + "/metrics").text)
    ok = statuses.count(200)
    print(
        f"{scenario} (seed {seed}), workers on {'the A100 profile' if mismatched else 'the bundled profile'}, effects "
        f"{'on' if effects else 'off'}, {rate:g} req/s: {ok} of {len(statuses)} ok (load average {os.getloadavg()[0]:.1f})"
    )
    for (component, instance), v in sorted(stats.items()):
        print(
            f"  {component:18s} {instance:24s} n={int(v['samples']):4d}  "
            f"MAPE {v['mape']:6.1%}  p90 coverage {v['p90_coverage']:.3f}"
        )
    pooled = {c: _pooled(stats, c) for c in sorted({c for c, _ in stats})}
    for c, (n, mape, cover) in pooled.items():
        print(f"  {c} pooled: n={n} MAPE {mape:.1%} coverage {cover:.3f}")
    return pooled


def _median_of_seeds(scenario: str, ttfts: list[tuple[int, float, float]]) -> tuple[int, float, float]:
    """The TTFT figures' median over the seeds (each figure apart), printed with their spread."""
    n, mape, cover = (statistics.median(column) for column in zip(*ttfts, strict=True))
    mapes, covers = [t[1] for t in ttfts], [t[2] for t in ttfts]
    print(
        f"{scenario}, TTFT over {len(ttfts)} seeds: MAPE median {mape:.1%} ({min(mapes):.1%}..{max(mapes):.1%}), "
        f"p90 coverage median {cover:.3f} ({min(covers):.3f}..{max(covers):.3f})"
    )
    return int(n), mape, cover


def _gateway_figures(url: str) -> dict[str, tuple[int, float, float]]:
    stats = _exported(httpx.get(url + "/metrics", timeout=30).text)
    return {c: _pooled(stats, c) for c in sorted({c for c, _ in stats})}


def main_vllm(args: argparse.Namespace) -> int:
    """--engines vllm: the figures on real vLLM CPU engines (benchmarks/prediction_vllm.py). The
    target is the bound's coverage; MAPE is reported (a busy 2-core box's scheduling noise on a
    ~30 ms TTFT is a MAPE no model of the request removes)."""
    from benchmarks.prediction_vllm import MEASURED as V_MEASURED
    from benchmarks.prediction_vllm import WARMUP as V_WARMUP
    from benchmarks.prediction_vllm import run_vllm

    counts = (args.warmup or V_WARMUP, args.measured or V_MEASURED)
    kinds = tuple(args.prompts.split(","))
    missed = []
    t0 = time.monotonic()
    for scenario in ("mixed", "pd") if args.scenario == "all" else (args.scenario,):
        results = run_vllm(scenario, kinds, args.rate, counts, not args.no_online, _gateway_figures)
        for kind, figures in results.items():
            n, _, cover = figures.get("ttft", (0, 1.0, 0.0))
            if not (n >= 0.9 * counts[1] and 0.85 <= cover <= 0.95):
                missed.append(f"{scenario}/{kind}")
    print(
        f"target (n >= {0.9 * counts[1]:.0f}, TTFT p90 coverage 0.85..0.95): "
        f"{'MISSED on ' + ', '.join(missed) if missed else 'met'} ({time.monotonic() - t0:.0f} s wall)"
    )
    return 1 if missed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=("pd", "mixed", "all"), default="all")
    ap.add_argument("--engines", choices=("emulated", "vllm"), default="emulated", help="vllm: real vLLM CPU engines")
    ap.add_argument("--prompts", default="unique,shared", help="vllm: workloads, of unique,shared")
    ap.add_argument("--warmup", type=int, default=0, help="vllm: warm-up requests per workload")
    ap.add_argument("--measured", type=int, default=0, help="vllm: measured requests per workload")
    ap.add_argument("--no-online", action="store_true", help="vllm: online learning off (the control)")
    ap.add_argument("--matched", action="store_true", help="workers on the bundled profile (the by-construction setup)")
    ap.add_argument("--no-effects", action="store_true", help="workers without the timing effects")
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (default: ~65%% of capacity)")
    ap.add_argument("--seeds", type=int, default=4, help="emulated: runs per scenario, each its own seed (the median is judged)")
    args = ap.parse_args()
    if args.engines == "vllm":
        return main_vllm(args)
    t0 = time.monotonic()
    missed = []
    for scenario in ("pd", "mixed") if args.scenario == "all" else (args.scenario,):
        runs = [run(scenario, not args.matched, not args.no_effects, args.rate, k) for k in range(args.seeds)]
        n, mape, cover = _median_of_seeds(scenario, [r.get("ttft", (0, 1.0, 0.0)) for r in runs])
        if not (n >= 0.95 * MEASURED and mape <= 0.10 and 0.85 <= cover <= 0.95):
            missed.append(scenario)
    print(
        f"targets, on the median over seeds (n >= {0.95 * MEASURED:.0f}, TTFT MAPE <= 10%, p90 coverage 0.85..0.95): "
        f"{'MISSED on ' + ', '.join(missed) if missed else 'met'} ({time.monotonic() - t0:.0f} s wall)"
    )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
