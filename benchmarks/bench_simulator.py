"""Simulator benchmarks: speed targets and the paper's figures, side by side with ratios.

    python benchmarks/bench_simulator.py            # everything (tens of minutes on 2 cores)
    python benchmarks/bench_simulator.py speed fig5 # some sections: speed, sweep, fig5, fig15, table3, fair, ratios,
                                                    # ratios-direct, sessions
    python benchmarks/bench_simulator.py ratios --seeds 4 --markdown   # docs/simulator.md's tables

Settings: the conversation / synthetic traces bundled in traces/data; `--paper` truth model (the
bundled Qwen3-8B/H800 profile with prefill cost x7 and 320 KB of KV per token, emulating the
paper's LLaMA3-70B on 8xA800; the cluster size is the paper's, 16 nodes). Every section prints
the setting it ran. Two of them reproduce the paper only in a stated setting: Fig. 5 needs
`--paper` (with the profile's own 8B prefill cost the cluster is idle and the schedulers tie),
and Table 3's ordering (predicted rejects fewer than early) only shows in a tuned decode-bound
setting, 8P+4D with a 45 ms TBT SLO; on the --paper defaults (8P+8D) decode never binds and the
two modes coincide. Prefix pulls: peer-to-peer allowed (`--pull both`, no store configured), except
`ratios`, whose pulls are the live gateway's (`--pull staged`; `ratios-direct` is the `--pull both`
variant). `ratios` runs every cell over `--seeds` seeds (benchmarks/sim_ratios.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import sim_ratios
from traces.agent_trace import AgentWorkload, generate
from traces.agent_trace import write as write_agent
from traces.sim.options import add_cluster_args, config_from_args, describe
from traces.sim.results import RunResult
from traces.sim.runner import PolicySpec, SimJob, default_workers, load_requests, run_job, run_jobs
from traces.tune import format_sweep, sweep

FIG5_PAPER = {"random": 19.65, "least_loaded": 5.27, "sglang_cache_aware": 3.58, "kvcache_aware:admission=none": 3.07}
TABLE3_PAPER = {"none": 4183, "early": 3771, "predicted": 3589}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


SIM_TARGET_S = 1.5  # the whole conversation trace, one policy, one core
SWEEP_TARGET_S = 15.0  # 15 splits of 16 nodes, kvcache_aware, all cores
SPEED_POLICIES = ("random", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv", "llmd", "kvcache_aware")


def _load() -> str:
    """The 1-minute load average, for the record: on a shared box wall time moves with it."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the finished child processes (run_jobs' workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reference_loop_s() -> float:
    """CPU seconds of an empty 10M-iteration Python loop, best of three: how fast this box runs
    Python today. The sessions' machines have differed by 2x in it, and the figures below with it."""
    best = float("inf")
    for _ in range(3):
        c0 = time.process_time()
        for _ in range(10_000_000):
            pass
        best = min(best, time.process_time() - c0)
    return best


def bench_speed() -> None:
    config = config_from_args(_args("--paper"), 8, 8)
    print(f"== speed: whole conversation trace (12,031 requests), {describe(config)}")
    print(f"   target <= {SIM_TARGET_S} s of simulation per policy (trace loading counted apart); the ratio is of")
    print("   CPU time (process_time), which other work on a shared box moves less than wall time")
    print(f"   this box: an empty 10M-iteration Python loop takes {_reference_loop_s():.2f} s CPU")
    t0 = time.perf_counter()
    reqs = load_requests("conversation")
    print(f"{'trace load':>20}: {time.perf_counter() - t0:6.2f} s")
    for name in SPEED_POLICIES:
        t0, c0 = time.perf_counter(), time.process_time()
        res = run_job(SimJob(PolicySpec(name), config, "conversation"), reqs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(
            f"{name:>20}: {cpu:6.2f} s CPU, {wall:6.2f} s wall (target {SIM_TARGET_S} s, ratio "
            f"{cpu / SIM_TARGET_S:.2f}), {res.completed} completed, {res.extra['events']:.0f} events, "
            f"load {_load()}"
        )


def bench_sweep() -> None:
    print(
        f"== speed: 15-split sweep of the conversation trace on 16 nodes, kvcache_aware, --paper, "
        f"{default_workers()} worker processes; target <= {SWEEP_TARGET_S} s"
    )
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu_s()
    result = sweep("conversation", 16, PolicySpec("kvcache_aware"), _args("--paper"))
    wall, cpu, workers = time.perf_counter() - t0, time.process_time() - c0, _children_cpu_s() - k0
    print(format_sweep(result))
    print(
        f"sweep wall time {wall:.1f} s (target {SWEEP_TARGET_S} s, ratio {wall / SWEEP_TARGET_S:.2f}); CPU "
        f"{workers:.1f} s in the workers, {cpu:.1f} s in this process (trace load, fork, results); load {_load()}"
    )


def bench_fig5() -> None:
    config = config_from_args(_args("--paper"), 8, 8)
    print("== FAST'25 Fig. 5: mean TTFT by prefill scheduler, conversation trace, no admission control; needs --paper")
    print(f"   {describe(config)}")
    names = ["random", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv", "llmd", "kvcache_aware:admission=none"]
    results = {r.policy: r for r in run_jobs([SimJob(PolicySpec.parse(n), config, "conversation") for n in names])}
    ours_ref = results["kvcache_aware:admission=none"].ttft.mean
    print(f"{'policy':>30}  {'sim TTFT':>9}  {'paper':>7}  {'sim/ours':>8}  {'paper/ours':>10}  {'hit local+pulled':>16}")
    for name in names:
        r = results[name]
        paper = FIG5_PAPER.get(name)
        paper_s = f"{paper:6.2f}s" if paper else "      -"
        ratio = f"{paper / FIG5_PAPER['kvcache_aware:admission=none']:10.2f}" if paper else "         -"
        hit = r.prefix_hit_local + r.prefix_hit_remote + r.prefix_hit_store
        print(f"{name:>30}  {r.ttft.mean:8.2f}s  {paper_s}  {r.ttft.mean / ours_ref:8.2f}  {ratio}  {hit:16.1%}")


def bench_fig15() -> None:
    print("== FAST'25 Fig. 15: P:D sweep, synthetic trace, 16 nodes, SLO TTFT 10 s / TBT 100 ms, kvcache_aware")
    print("   (decode KV capacity 100k tokens per instance; the paper reports its optimum near 1:1)")
    args = _args("--paper", "--slo-ttft", "10", "--slo-tbt", "0.1", "--decode-kv-tokens", "100000")
    print(f"   {describe(config_from_args(args, 8, 8)).split(', ', 1)[1]}")
    result = sweep("synthetic", 16, PolicySpec("kvcache_aware"), args)
    print(format_sweep(result))
    best, pick = result.best, result.pick
    edges = max(result.results[0].goodput_rps, result.results[-1].goodput_rps)
    ratio = best.goodput_rps / max(edges, 1e-9)
    print(
        f"best {best.n_prefill}:{best.n_decode}, recommended {pick.n_prefill}:{pick.n_decode} (paper ~8:8); "
        f"best/edge goodput ratio {ratio:.1f}"
    )


# The setting where judging the decode load *at arrival* matters (arXiv 7.3-7.4): decode-bound (the
# TBT SLO binds on 4 decode instances) while prefill queueing makes the TTFT (10-20 s) comparable
# with a stream's decode time (~14 s for the trace's ~340 output tokens at ~42 ms). Then "load
# now" is stale by a decode lifetime: it counts streams that will be gone and misses the ones in
# prefill, and rejects in the wrong phase. Both modes judge TTFT and TBT on calibrated quantiles
# (policies.kvcache_aware: ttft_quantile 0.95, tbt_quantile as given). Sensitivity: with the TBT
# SLO at 40 ms predicted still rejects ~10% fewer but ~2% fewer meet both SLOs; at 35 ms (TTFT
# of 3-6 s, far shorter than a decode) it rejects more.
DECODE_BOUND = ("--slo-ttft", "30", "--slo-tbt", "0.045")
DECODE_BOUND_40 = ("--slo-ttft", "30", "--slo-tbt", "0.04")
DECODE_BOUND_PD = (8, 4)


def _table3_run(
    seed: int, extra: tuple[str, ...], pd: tuple[int, int], options: dict[str, object], limit: int | None = None
) -> dict[str, RunResult]:
    config = config_from_args(_args("--paper", "--speedup", "2", "--seed", str(seed), *extra), *pd)
    specs = [PolicySpec("kvcache_aware", {"admission": m, **options}, m) for m in ("none", "early", "predicted")]
    return {r.policy: r for r in run_jobs([SimJob(s, config, "conversation", limit) for s in specs])}


def bench_table3() -> None:
    print("== arXiv Table 3: requests rejected at 2x replay speed, conversation trace (12,031 requests; the paper")
    print("   replayed 23,000 on 8P+8D). 'none' = no SLO admission (the simulator's bounded queue rejects).")
    print("   Reproduces only in the tuned decode-bound setting (8P+4D, TBT SLO 45 ms); elsewhere it is shown for contrast.")
    print("   prefill-bound: the --paper defaults on 8P+8D (decode never binds: early == predicted);")
    print(
        f"   decode-bound: {DECODE_BOUND_PD[0]}P+{DECODE_BOUND_PD[1]}D, "
        + " ".join(DECODE_BOUND)
        + " (SLO TTFT 30 s as in the report's 8.1.3), tbt_quantile 0.8; 'slice' = first 3,000 requests"
    )
    print(
        f"{'scenario':>14}  {'seed':>4}  {'mode':>9}  {'rejected':>8}  {'paper':>6}  {'SLO met':>7}  "
        f"{'rej/early':>9}  {'paper ratio':>11}  {'met/early':>9}"
    )
    runs: list[tuple[str, int, tuple[str, ...], tuple[int, int], dict[str, object], int | None]] = [
        ("prefill-bound", 0, (), (8, 8), {}, None),
        ("decode-bound", 0, DECODE_BOUND, DECODE_BOUND_PD, {"tbt_quantile": 0.8}, None),
        ("decode-bound", 1, DECODE_BOUND, DECODE_BOUND_PD, {"tbt_quantile": 0.8}, None),
        ("TBT SLO 40 ms", 0, DECODE_BOUND_40, DECODE_BOUND_PD, {"tbt_quantile": 0.8}, None),
        ("decode, slice", 0, DECODE_BOUND, DECODE_BOUND_PD, {"tbt_quantile": 0.8}, 3000),
        ("decode, slice", 1, DECODE_BOUND, DECODE_BOUND_PD, {"tbt_quantile": 0.8}, 3000),
    ]
    for scenario, seed, extra, pd, options, limit in runs:
        res = _table3_run(seed, extra, pd, options, limit)
        early = res["early"]
        for mode in ("none", "early", "predicted"):
            r = res[mode]
            print(
                f"{scenario:>14}  {seed:>4}  {mode:>9}  {r.rejected:>8}  {TABLE3_PAPER[mode]:>6}  {r.slo_met:>7}  "
                f"{r.rejected / max(1, early.rejected):9.2f}  {TABLE3_PAPER[mode] / TABLE3_PAPER['early']:11.2f}  "
                f"{r.slo_met / max(1, early.slo_met):9.2f}"
            )


def bench_fair() -> None:
    config = config_from_args(_args("--paper", "--speedup", "2"), 8, 8)
    print("== like for like: every baseline judged by kvcache_aware's online-fitted predictors and predicted")
    print(f"   admission (fit_predictors=true), conversation trace at 2x; {describe(config)}")
    names = ["random", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv", "llmd"]
    specs = [PolicySpec(n, {"fit_predictors": True}, f"{n}+fitted") for n in names] + [PolicySpec("kvcache_aware")]
    results = run_jobs([SimJob(s, config, "conversation") for s in specs])
    print(f"{'policy':>26}  {'rejected':>8}  {'SLO met':>7}  {'goodput':>8}  {'TTFT mean':>9}  {'TTFT pred err':>13}")
    for r in results:
        print(
            f"{r.policy:>26}  {r.rejected:>8}  {r.slo_met:>7}  {r.goodput_rps:8.2f}  {r.ttft.mean:8.2f}s  "
            f"{r.ttft_prediction.mean_rel:13.1%}"
        )


def _hit(r: RunResult) -> float:
    return r.prefix_hit_local + r.prefix_hit_remote + r.prefix_hit_store


# Capacity at SLO with and without session tags (issue 37): the agent workload of traces/agent_trace.py,
# one trace per seed, on 8P+8D --paper with an interactive TTFT SLO (5 s; TBT 100 ms): the highest
# replay speed-up at which SESSION_GOAL of the requests meet both SLOs (rejected ones count as missed),
# found by bisection, as a request rate; with the policy's KV index exact, lagging and off
SESSION_SEEDS = (1, 2, 3, 4)
SESSION_SLO = ("--slo-ttft", "5", "--slo-tbt", "0.1")
SESSION_GOAL = 0.9
SESSION_RANGE = (1.0, 12.0)  # speed-ups bracketing the capacity of every seed and index
SESSION_STEPS = 7  # bisection steps: the capacity to (12 - 1) / 2**7 = 0.09x
SESSION_INDEXES: dict[str, tuple[str, ...]] = {
    "exact index": (),
    "index 10 s late": ("--index-delay", "10"),
    "no index": ("--no-index",),
}
SessionKey = tuple[str, int, bool]  # (index, seed, tags)


def _agent_trace(seed: int, folder: Path) -> tuple[str, float]:
    """One seed's agent workload written as a trace with its session ids; (path, its requests per second)."""
    records = generate(AgentWorkload(seed=seed))
    path = folder / f"agent-{seed}.jsonl.gz"
    write_agent(path, records)
    return str(path), len(records) / max(1e-3, records[-1].timestamp_ms / 1000)


def _session_runs(traces: dict[int, str], speedups: dict[SessionKey, float]) -> dict[SessionKey, RunResult]:
    jobs, keys = [], []
    for (index, seed, tags), speedup in speedups.items():
        argv = ["--paper", "--speedup", f"{speedup:g}", "--seed", str(seed), *SESSION_SLO, *SESSION_INDEXES[index]]
        config = config_from_args(_args(*argv, *([] if tags else ["--no-session-tags"])), 8, 8)
        jobs.append(SimJob(PolicySpec("kvcache_aware"), config, traces[seed]))
        keys.append((index, seed, tags))
    return dict(zip(keys, run_jobs(jobs), strict=True))


def _session_capacity(traces: dict[int, str]) -> tuple[dict[SessionKey, float], dict[SessionKey, RunResult]]:
    """Each (index, seed, tags)'s capacity speed-up by bisection, and its run at that speed-up."""
    low = {(index, seed, tags): SESSION_RANGE[0] for index in SESSION_INDEXES for seed in SESSION_SEEDS for tags in (False, True)}
    high = dict.fromkeys(low, SESSION_RANGE[1])
    last: dict[SessionKey, RunResult] = {}
    for _ in range(SESSION_STEPS):
        mid = {key: (low[key] + high[key]) / 2 for key in low}
        for key, r in _session_runs(traces, mid).items():
            if r.slo_attainment >= SESSION_GOAL:
                low[key], last[key] = mid[key], r
            else:
                high[key] = mid[key]
    return low, last


def bench_sessions() -> None:
    print("== capacity at SLO with and without session tags: the agent workload (traces/agent_trace.py), one trace")
    print(f"   per seed {SESSION_SEEDS}; kvcache_aware (session_affinity on; without tags it has nothing to follow),")
    print(f"   8P+8D --paper, {' '.join(SESSION_SLO)}; capacity: the highest rate at which {SESSION_GOAL:.0%} of the")
    print(f"   requests meet both SLOs (bisection over the replay speed-up, {SESSION_STEPS} steps); the policy's KV")
    flags = "; ".join(f"{k}: {' '.join(v) or 'default'}" for k, v in SESSION_INDEXES.items())
    print(f"   index exact, lagging or off ({flags})")
    with tempfile.TemporaryDirectory() as tmp:
        made = {seed: _agent_trace(seed, Path(tmp)) for seed in SESSION_SEEDS}
        low, last = _session_capacity({seed: path for seed, (path, _) in made.items()})
    counts = ("first", "unhinted", "prefill_decided", "prefill_agreed", "prefill_moved")
    print(
        f"{'index':>15}  {'seed':>4}  {'tags':>5}  {'capacity req/s':>14}  {'speed-up':>8}  {'at it: met':>10}  "
        f"{'TTFT mean':>9}  {'hit':>5}  {'first/unhinted/hint decided/agreed/moved':>40}"
    )
    for index in SESSION_INDEXES:
        capacity: dict[bool, list[float]] = {False: [], True: []}
        for seed in SESSION_SEEDS:
            for tags in (False, True):
                rate = low[index, seed, tags] * made[seed][1]
                capacity[tags].append(rate)
                r = last.get((index, seed, tags))
                if r is None:
                    print(f"{index:>15}  {seed:>4}  {tags!s:>5}  below {SESSION_RANGE[0]:g}x")
                    continue
                c = "/".join(f"{r.extra.get(f'session_{k}', 0):.0f}" for k in counts)
                print(
                    f"{index:>15}  {seed:>4}  {tags!s:>5}  {rate:14.2f}  {low[index, seed, tags]:7.2f}x  "
                    f"{r.slo_attainment:10.1%}  {r.ttft.mean:8.2f}s  {_hit(r):5.1%}  {c:>40}"
                )
        for tags in (False, True):
            rates = sorted(capacity[tags])
            print(
                f"{index}, tags {'on ' if tags else 'off'}: median {statistics.median(rates):.2f} req/s, "
                f"spread {rates[0]:.2f} .. {rates[-1]:.2f}"
            )
        ratios = [t / max(1e-9, f) for f, t in zip(capacity[False], capacity[True], strict=True)]
        per_seed = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"{index}, with / without tags per seed: {per_seed} (median {statistics.median(ratios):.3f})")


def _plain(bench: Callable[[], None]) -> Callable[[argparse.Namespace], None]:
    return lambda _: bench()


def _ratios(pull: str) -> Callable[[argparse.Namespace], None]:
    return lambda opts: sim_ratios.bench(pull, opts.seeds, opts.limit, opts.markdown)


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "speed": _plain(bench_speed),
    "sweep": _plain(bench_sweep),
    "fig5": _plain(bench_fig5),
    "fig15": _plain(bench_fig15),
    "table3": _plain(bench_table3),
    "fair": _plain(bench_fair),
    "ratios": _ratios("staged"),  # the pulls the live gateway can carry out
    "ratios-direct": _ratios("both"),  # a prefill reads a peer's cache directly: not on live vLLM
    "sessions": _plain(bench_sessions),
}


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """Sections to run, in the order given (none given: all of them), and the ratio tables' options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of: {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--seeds", type=int, default=4, help="ratios: seeds 0..N-1 per cell (default 4)")
    parser.add_argument("--limit", type=int, default=None, help="ratios: the first N requests of each trace")
    parser.add_argument("--markdown", action="store_true", help="ratios: the tables as markdown, for the docs")
    opts = parser.parse_args(argv)
    unknown = [n for n in opts.sections if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if opts.seeds < 1:
        parser.error("--seeds must be at least 1")
    opts.sections = opts.sections or list(SECTIONS)
    return opts


def parse_sections(argv: list[str] | None = None) -> list[str]:
    """Section names to run, in the order given; none given: all of them."""
    names: list[str] = parse_options(argv).sections
    return names


def main(argv: list[str] | None = None) -> int:
    opts = parse_options(argv)
    for name in opts.sections:
        t0 = time.perf_counter()
        SECTIONS[name](opts)
        print(f"({name}: {time.perf_counter() - t0:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
