"""Simulator benchmarks: speed targets and the paper's figures, side by side with ratios.

    python benchmarks/bench_simulator.py            # everything (a few minutes on 2 cores)
    python benchmarks/bench_simulator.py speed fig5 # some sections: speed, sweep, fig5, fig15, table3, fair, ratios,
                                                    # ratios-staged, sessions

Settings: the conversation / synthetic traces bundled in traces/data; `--paper` truth model (the
bundled Qwen3-8B/H800 profile with prefill cost x7 and 320 KB of KV per token, emulating the
paper's LLaMA3-70B on 8xA800; the cluster size is the paper's, 16 nodes). Every section prints
the setting it ran. Two of them reproduce the paper only in a stated setting: Fig. 5 needs
`--paper` (with the profile's own 8B prefill cost the cluster is idle and the schedulers tie),
and Table 3's ordering (predicted rejects fewer than early) only shows in a tuned decode-bound
setting, 8P+4D with a 45 ms TBT SLO; on the --paper defaults (8P+8D) decode never binds and the
two modes coincide. Prefix pulls: peer-to-peer allowed (`--pull both`, no store configured).
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

from traces.agent_trace import AgentWorkload, generate
from traces.agent_trace import write as write_agent
from traces.formats import reusable_prefix_share
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


# Speed-ups where the best baseline (fitted predictors, predicted admission) met 80-90% and 60-70%
# of both SLOs in the --paper setting, found with runs of every baseline on 2026-12-01; the table
# prints the share it met this time, so a drifted calibration shows.
RATIO_LOADS: dict[str, tuple[float, float]] = {
    "conversation": (2.5, 3.5),
    "synthetic": (2.5, 3.5),
    "tool-agent": (4.0, 5.0),
}
RATIO_BASELINES = ("random", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv", "llmd")
# '+local': kvcache_aware that may also prefill short prompts on a decode instance itself
# (policies/local_prefill.py; vLLM decodes with kv_role kv_both do), at most this share of its time
LOCAL_PREFILL: dict[str, object] = {"local_prefill_tokens": 8192, "local_prefill_duty": 0.25}
RATIO_GOAL = 1.15  # kvcache_aware / best baseline, on at least two of the three workloads; never below 1.0


def _hit(r: RunResult) -> float:
    return r.prefix_hit_local + r.prefix_hit_remote + r.prefix_hit_store


def bench_ratios(pull: str = "both") -> None:
    how = {
        "both": "peer pulls read directly",
        "staged": "peer pulls staged on the holder with priority, as the gateway drives them over vLLM NIXL (--pull staged)",
    }[pull]
    print("== kvcache_aware against the best baseline, equal fitted predictors and predicted admission,")
    print(f"   at the loads where the best baseline meets 80-90% and 60-70% of both SLOs; 8P+8D --paper, {how}")
    print("   'Algorithm 1' is kvcache_aware as the paper states it: lowest predicted TTFT, blind to prefixes in")
    print("   flight (ttft_slack none, inflight_prefixes false)")
    tokens, duty = LOCAL_PREFILL["local_prefill_tokens"], LOCAL_PREFILL["local_prefill_duty"]
    print(f"   '+local': kvcache_aware that may also prefill prompts of up to {tokens} tokens on a")
    print(f"   decode instance, within {duty:.0%} of its time (policies/local_prefill.py); met: its SLO")
    print("   attainment, TBT ms: its mean TBT, local: prefills it ran on decodes. The baselines never do")
    print("   hit: prefix-cache hit rate of the served prompts (local + pulled), best baseline / kvcache_aware;")
    print("   reusable: the trace's own bound on any policy's hit rate (traces.formats.reusable_prefix_share)")
    head = (
        f"{'workload':>13}  {'speed-up':>8}  {'best baseline':>18}  {'its SLO met':>11}  {'goodput':>7}  "
        f"{'kvcache_aware':>13}  {'ratio':>5}  {'Algorithm 1':>11}  {'ratio':>5}  {'+local':>7}  {'ratio':>5}  "
        f"{'met':>5}  {'TBT ms':>6}  {'local':>6}  {'hit':>9}  {'reusable':>8}"
    )
    print(head)
    wins: dict[str, list[float]] = {}
    local_wins: dict[str, list[float]] = {}
    why: list[tuple[str, float, RunResult, RunResult]] = []
    for trace, loads in RATIO_LOADS.items():
        reusable = reusable_prefix_share(load_requests(trace))
        for speedup in loads:
            config = config_from_args(_args("--paper", "--speedup", str(speedup), "--pull", pull), 8, 8)
            specs = [PolicySpec(n, {"fit_predictors": True}, n) for n in RATIO_BASELINES]
            specs += [
                PolicySpec("kvcache_aware"),
                PolicySpec("kvcache_aware", {"ttft_slack": None, "inflight_prefixes": False}, "algorithm1"),
                PolicySpec("kvcache_aware", LOCAL_PREFILL, "local"),
            ]
            results = run_jobs([SimJob(spec, config, trace) for spec in specs])
            best = max(results[: len(RATIO_BASELINES)], key=lambda r: r.goodput_rps)
            ours, alg1, local = results[len(RATIO_BASELINES) :]
            ratio, local_ratio = ours.goodput_rps / best.goodput_rps, local.goodput_rps / best.goodput_rps
            wins.setdefault(trace, []).append(ratio)
            local_wins.setdefault(trace, []).append(local_ratio)
            why.append((trace, speedup, best, ours))
            print(
                f"{trace:>13}  {speedup:>7.1f}x  {best.policy:>18}  {best.slo_attainment:>10.0%}  "
                f"{best.goodput_rps:7.2f}  {ours.goodput_rps:13.2f}  {ratio:5.2f}  {alg1.goodput_rps:11.2f}  "
                f"{alg1.goodput_rps / best.goodput_rps:5.2f}  {local.goodput_rps:7.2f}  {local_ratio:5.2f}  "
                f"{local.slo_attainment:5.0%}  {local.tbt.mean * 1e3:5.1f}  {local.extra['local_prefills']:6.0f}  "
                f"{_hit(best):.0%} / {_hit(ours):.0%}  {reusable:8.0%}"
            )
    print("   why: prefill s per served request (its prompt mix and its reuse), best baseline / kvcache_aware, and")
    print("   the prefills' busy share. Where both keep the prefills busy, goodput is prefill capacity over that cost,")
    print("   so the goodput ratio is about the cost ratio; reuse beyond the trace's bound is not available to it")
    for trace, speedup, best, ours in why:
        b, o = best.extra, ours.extra
        print(
            f"{trace:>13}  {speedup:>7.1f}x  cost {b['prefill_s_per_served']:.3f} / {o['prefill_s_per_served']:.3f} s "
            f"(ratio {b['prefill_s_per_served'] / o['prefill_s_per_served']:.2f})  served prompt "
            f"{b['served_prompt_mean']:,.0f} / {o['served_prompt_mean']:,.0f} tokens  prefills busy "
            f"{b['prefill_busy']:.0%} / {o['prefill_busy']:.0%}"
        )
    for label, table in (("kvcache_aware, P/D only", wins), ("kvcache_aware with local prefills", local_wins)):
        reached = [t for t, rs in table.items() if min(rs) >= RATIO_GOAL]
        floor = min(r for rs in table.values() for r in rs)
        print(
            f"goal ({label}): >= {RATIO_GOAL}x at both loads on at least two workloads, never below 1.0x: "
            f"{len(reached)} of {len(table)} workloads reach it ({', '.join(reached) or 'none'}), "
            f"lowest ratio {floor:.2f}x"
        )


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


SECTIONS: dict[str, Callable[[], None]] = {
    "speed": bench_speed,
    "sweep": bench_sweep,
    "fig5": bench_fig5,
    "fig15": bench_fig15,
    "table3": bench_table3,
    "fair": bench_fair,
    "ratios": bench_ratios,
    "ratios-staged": lambda: bench_ratios("staged"),
    "sessions": bench_sessions,
}


def parse_sections(argv: list[str] | None = None) -> list[str]:
    """Section names to run, in the order given; none given: all of them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of: {', '.join(SECTIONS)} (default: all)")
    names: list[str] = parser.parse_args(argv).sections
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return names or list(SECTIONS)


def main(argv: list[str] | None = None) -> int:
    for name in parse_sections(argv):
        t0 = time.perf_counter()
        SECTIONS[name]()
        print(f"({name}: {time.perf_counter() - t0:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
