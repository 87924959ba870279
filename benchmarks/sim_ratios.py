"""kvcache_aware against the best baseline in the simulator, over several seeds (bench_simulator.py
ratios / ratios-direct, issue 39).

Each cell is a workload at a replay speed-up. Every seed (the truth model's noise, `--seed`) runs
every baseline, kvcache_aware, Algorithm 1 and '+local' on the same cluster. The best baseline is
picked per seed: the baseline with the highest goodput in that cell and seed, so the ratio of each
seed is against the strongest baseline that seed produced (a noisy baseline that wins one seed
wins it). A cell reports the median ratio over the seeds with its min..max, and which baselines won.

The headline pulls are `--pull staged`, what the live gateway carries out over stock vLLM NIXL; the
simulator does not model readback from decodes (docs/simulator.md, "Not modelled"), so that is all
the live gateway's pulls it can give. `--pull both` (a prefill reads a peer's cache directly, which
vLLM 0.32 cannot) is the labelled `ratios-direct` variant. '+local' (prefills on decodes) is
summarised in its own table: it needs kv_both decodes, and no baseline computes on a decode.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from traces.formats import reusable_prefix_share
from traces.sim.options import add_cluster_args, config_from_args
from traces.sim.results import RunResult
from traces.sim.runner import PolicySpec, SimJob, load_requests, run_jobs

# Speed-ups where the best baseline (fitted predictors, predicted admission) met 80-90% and 60-70%
# of both SLOs in the --paper setting, found with runs of every baseline on 2026-12-01 (seed 0);
# the tables print the share it met, so a drifted calibration shows.
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
PULLS = {
    "staged": "peer pulls staged on the holder with priority, as the live gateway drives them over vLLM "
    "NIXL (--pull staged; decode readback is not modelled)",
    "both": "DIRECT-READ variant: a prefill reads a peer's cache directly (--pull both), which live vLLM 0.32 "
    "cannot; not the headline",
}


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of some seeds' values and their range."""

    median: float
    low: float
    high: float

    @staticmethod
    def of(values: Iterable[float]) -> Spread:
        xs = sorted(values)
        if not xs:
            raise ValueError("a spread of no values")
        return Spread(statistics.median(xs), xs[0], xs[-1])

    def text(self, spec: str = ".2f") -> str:
        return f"{self.median:{spec}} ({self.low:{spec}}..{self.high:{spec}})"


@dataclass(frozen=True, slots=True)
class SeedRuns:
    """One seed's runs in one cell: every baseline, kvcache_aware, Algorithm 1 and '+local'."""

    seed: int
    baselines: tuple[RunResult, ...]
    ours: RunResult
    alg1: RunResult
    local: RunResult

    @property
    def best(self) -> RunResult:
        """The baseline with the highest goodput this seed (the first listed on a tie)."""
        return max(self.baselines, key=lambda r: r.goodput_rps)


def hit(r: RunResult) -> float:
    """Share of the served prompts' tokens that came from a cache, local or pulled."""
    return r.prefix_hit_local + r.prefix_hit_remote + r.prefix_hit_store


@dataclass(frozen=True, slots=True)
class Cell:
    """A workload at a speed-up, summarised over its seeds; ratios are per seed, against that seed's best."""

    trace: str
    speedup: float
    seeds: tuple[SeedRuns, ...]
    reusable: float = 0.0  # the trace's own bound on any policy's hit rate

    def _over(self, value: Callable[[SeedRuns], float]) -> Spread:
        return Spread.of(value(s) for s in self.seeds)

    @property
    def winners(self) -> Counter[str]:
        return Counter(s.best.policy for s in self.seeds)

    def winners_text(self) -> str:
        return ", ".join(f"{name} {n}" for name, n in self.winners.most_common())

    @property
    def best_goodput(self) -> Spread:
        return self._over(lambda s: s.best.goodput_rps)

    @property
    def best_met(self) -> Spread:
        return self._over(lambda s: s.best.slo_attainment)

    def goodput(self, which: str) -> Spread:
        return self._over(lambda s: _policy(s, which).goodput_rps)

    def ratio(self, which: str) -> Spread:
        """`which` (ours, alg1, local) over the best baseline of the same seed."""
        return self._over(lambda s: _policy(s, which).goodput_rps / max(1e-9, s.best.goodput_rps))

    def per_seed(self, which: str) -> list[float]:
        return [_policy(s, which).goodput_rps / max(1e-9, s.best.goodput_rps) for s in self.seeds]


def _policy(s: SeedRuns, which: str) -> RunResult:
    return {"ours": s.ours, "alg1": s.alg1, "local": s.local, "best": s.best}[which]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


def _specs() -> list[PolicySpec]:
    return [
        *(PolicySpec(n, {"fit_predictors": True}, n) for n in RATIO_BASELINES),
        PolicySpec("kvcache_aware"),
        PolicySpec("kvcache_aware", {"ttft_slack": None, "inflight_prefixes": False}, "algorithm1"),
        PolicySpec("kvcache_aware", LOCAL_PREFILL, "local"),
    ]


def run_cells(pull: str, seeds: Sequence[int], limit: int | None = None) -> list[Cell]:
    """Every workload at its two speed-ups, every seed; one batch of parallel runs per workload."""
    specs, n = _specs(), len(RATIO_BASELINES)
    cells = []
    for trace, loads in RATIO_LOADS.items():
        keys = [(speedup, seed) for speedup in loads for seed in seeds]
        jobs = []
        for speedup, seed in keys:
            argv = ("--paper", "--speedup", str(speedup), "--pull", pull, "--seed", str(seed))
            config = config_from_args(_args(*argv), 8, 8)
            jobs += [SimJob(spec, config, trace, limit) for spec in specs]
        results = run_jobs(jobs)
        by_key = {key: results[i * len(specs) : (i + 1) * len(specs)] for i, key in enumerate(keys)}
        reusable = reusable_prefix_share(load_requests(trace, limit))
        for speedup in loads:
            runs = tuple(SeedRuns(seed, tuple(by_key[speedup, seed][:n]), *by_key[speedup, seed][n:]) for seed in seeds)
            cells.append(Cell(trace, speedup, runs, reusable))
    return cells


def goal_lines(cells: Sequence[Cell]) -> list[str]:
    """The goal (>= RATIO_GOAL at both loads on two workloads, never below 1.0) on the medians and on every seed."""
    out = []
    for label, which in (("kvcache_aware, P/D only", "ours"), ("'+local', needs kv_both decodes", "local")):
        for over, pick in (("median", lambda s: s.median), ("every seed", lambda s: s.low)):
            table: dict[str, list[float]] = {}
            for c in cells:
                table.setdefault(c.trace, []).append(pick(c.ratio(which)))
            reached = [t for t, rs in table.items() if min(rs) >= RATIO_GOAL]
            floor = min(r for rs in table.values() for r in rs)
            out.append(
                f"goal ({label}, {over}): >= {RATIO_GOAL}x at both loads on at least two workloads, never below "
                f"1.0x: {len(reached)} of {len(table)} reach it ({', '.join(reached) or 'none'}), lowest {floor:.2f}x"
            )
    return out


def header(pull: str, seeds: Sequence[int], limit: int | None) -> list[str]:
    tokens, duty = LOCAL_PREFILL["local_prefill_tokens"], LOCAL_PREFILL["local_prefill_duty"]
    scope = "whole traces" if limit is None else f"the first {limit:,} requests of each trace"
    return [
        "== kvcache_aware against the best baseline, equal fitted predictors and predicted admission, at the",
        "   loads where the best baseline met 80-90% and 60-70% of both SLOs (seed 0, 2026-12-01); 8P+8D --paper,",
        f"   {scope}; pulls: {PULLS[pull]}",
        f"   seeds {', '.join(map(str, seeds))}: per seed, the best baseline is the one with the highest goodput in",
        "   that cell and seed, and the ratio is against it; cells show the median over the seeds (min..max)",
        "   'Algorithm 1': kvcache_aware as the paper states it (ttft_slack none, inflight_prefixes false)",
        f"   '+local' (its own table): kvcache_aware that may also prefill prompts of up to {tokens} tokens on a decode,",
        f"   within {duty:.0%} of its time; needs kv_both decodes, and no baseline computes on a decode",
    ]


_MAIN = (
    "workload",
    "speed-up",
    "best baseline (seeds won)",
    "its SLO met",
    "its goodput",
    "kvcache_aware",
    "ratio",
    "Algorithm 1",
    "ratio",
    "hit, best / kvcache_aware",
    "reusable",
)
_LOCAL = (
    "workload",
    "speed-up",
    "best baseline's goodput",
    "+local goodput",
    "+local ratio",
    "P/D-only ratio",
    "+local SLO met",
    "TBT ms",
    "local prefills",
)


def main_rows(cells: Sequence[Cell]) -> list[tuple[str, ...]]:
    """The headline table: medians over the seeds, ratios with their min..max."""
    return [
        (
            c.trace,
            f"{c.speedup:.1f}x",
            c.winners_text(),
            f"{c.best_met.median:.0%}",
            f"{c.best_goodput.median:.2f}",
            f"{c.goodput('ours').median:.2f}",
            c.ratio("ours").text(),
            f"{c.goodput('alg1').median:.2f}",
            c.ratio("alg1").text(),
            f"{statistics.median(hit(s.best) for s in c.seeds):.0%} / {statistics.median(hit(s.ours) for s in c.seeds):.0%}",
            f"{c.reusable:.0%}",
        )
        for c in cells
    ]


def local_rows(cells: Sequence[Cell]) -> list[tuple[str, ...]]:
    """'+local' apart: kvcache_aware with prefills on kv_both decodes, against the same best baselines."""
    return [
        (
            c.trace,
            f"{c.speedup:.1f}x",
            f"{c.best_goodput.median:.2f}",
            f"{c.goodput('local').median:.2f}",
            c.ratio("local").text(),
            f"{c.ratio('ours').median:.2f}",
            f"{statistics.median(s.local.slo_attainment for s in c.seeds):.0%}",
            f"{statistics.median(s.local.tbt.mean for s in c.seeds) * 1e3:.1f}",
            f"{statistics.median(s.local.extra.get('local_prefills', 0.0) for s in c.seeds):.0f}",
        )
        for c in cells
    ]


def markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def plain(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in (head, *rows))


def _why(c: Cell) -> str:
    """Prefill s per served request, best baseline / kvcache_aware (medians over the seeds)."""

    def med(value: Callable[[SeedRuns], float]) -> float:
        return statistics.median(value(s) for s in c.seeds)

    b_cost, o_cost = med(lambda s: s.best.extra["prefill_s_per_served"]), med(lambda s: s.ours.extra["prefill_s_per_served"])
    return (
        f"{c.trace:>13}  {c.speedup:>4.1f}x  cost {b_cost:.3f} / {o_cost:.3f} s (ratio {b_cost / o_cost:.2f})  "
        f"served prompt {med(lambda s: s.best.extra['served_prompt_mean']):,.0f} / "
        f"{med(lambda s: s.ours.extra['served_prompt_mean']):,.0f} tokens  prefills busy "
        f"{med(lambda s: s.best.extra['prefill_busy']):.0%} / {med(lambda s: s.ours.extra['prefill_busy']):.0%}"
    )


def report(cells: Sequence[Cell], *, as_markdown: bool) -> str:
    """Both tables (markdown to paste into docs/simulator.md, or plain), then, in plain text either way, the
    per-seed ratios, why the ratios stop where they do, and the goal."""
    fmt = markdown if as_markdown else plain
    parts = [fmt(_MAIN, main_rows(cells)), "", "'+local', needs kv_both decodes (not part of the ratio above):", ""]
    parts += [fmt(_LOCAL, local_rows(cells)), ""]
    parts.append("   per seed, kvcache_aware / that seed's best baseline (Algorithm 1; '+local'):")
    for c in cells:
        seeds = [
            f"{s.seed}: {o:.2f} ({a:.2f}; {lo:.2f}) vs {s.best.policy}" for s, o, a, lo in zip(c.seeds, *_per(c), strict=True)
        ]
        parts.append(f"{c.trace:>13}  {c.speedup:>4.1f}x  " + "  ".join(seeds))
    parts.append("   why: prefill s per served request, best baseline / kvcache_aware, and the prefills' busy share")
    parts += [_why(c) for c in cells]
    return "\n".join(parts + goal_lines(cells))


def _per(c: Cell) -> tuple[list[float], list[float], list[float]]:
    return c.per_seed("ours"), c.per_seed("alg1"), c.per_seed("local")


def bench(pull: str, seeds: int, limit: int | None, as_markdown: bool) -> None:
    """bench_simulator.py's `ratios` (pull staged) and `ratios-direct` (pull both) sections."""
    chosen = list(range(seeds))
    print("\n".join(header(pull, chosen, limit)))
    print(report(run_cells(pull, chosen, limit), as_markdown=as_markdown))
