"""`conductor tune-pd TRACE --nodes N`: sweep every P:D split of N nodes and recommend one.

    conductor tune-pd synthetic --nodes 16 --slo-ttft 10 --slo-tbt 0.1 --paper --speedup 2

Every split 1..N-1 prefill nodes is simulated (in parallel, one process per core) with the same
policy, trace and truth model. The best split has the highest goodput (requests per second meeting
both SLOs); ties go to the lower mean TTFT. Goodput is often flat near its peak: the *plateau* is
the run of adjacent splits around the best whose goodput is within `PLATEAU_TOLERANCE` (1%) of it,
and the recommended split is the plateau's middle -- the one that stays on the plateau when the
load mix shifts towards prefill or towards decode (for an even run, the middle split with more
goodput). A PNG of goodput, TTFT and TBT against the split, with the plateau shaded and the SLOs
drawn, is written when matplotlib (the `plot` extra) is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from conductor.core.cli_help import DefaultsHelpFormatter
from conductor.core.errors import ConductorError
from traces.formats import resolve_trace
from traces.sim.options import add_cluster_args, add_policy_args, apply_policy_args, config_from_args, describe
from traces.sim.results import RunResult
from traces.sim.runner import PolicySpec, SimJob, load_requests, run_jobs

PLATEAU_TOLERANCE = 0.01  # splits within 1% of the best goodput are on its plateau


def _split(r: RunResult) -> dict[str, int]:
    return {"prefill": r.n_prefill, "decode": r.n_decode}


@dataclass(frozen=True, slots=True)
class SweepResult:
    """Every split's result, in prefill-count order; the best, its plateau and the recommended one."""

    nodes: int
    results: tuple[RunResult, ...]
    best: RunResult  # highest goodput
    plateau: tuple[RunResult, ...] = ()  # adjacent splits around `best` within the tolerance
    recommended: RunResult | None = None  # the plateau's middle (None: `best`)

    @property
    def pick(self) -> RunResult:
        return self.recommended or self.best

    def as_dict(self) -> dict[str, object]:
        return {
            "nodes": self.nodes,
            "recommended": _split(self.pick),
            "best": _split(self.best),
            "plateau": [_split(r) for r in self.plateau],
            "plateau_tolerance": PLATEAU_TOLERANCE,
            "results": [r.as_dict() for r in self.results],
        }


def recommend(results: Sequence[RunResult]) -> RunResult:
    """Max goodput; ties (same number of requests meeting both SLOs) broken by lower mean TTFT."""
    if not results:
        raise ValueError("no sweep results to recommend from")
    return min(results, key=lambda r: (-r.slo_met, r.ttft.mean, r.n_prefill))


def plateau(results: Sequence[RunResult], best: RunResult, tolerance: float = PLATEAU_TOLERANCE) -> tuple[RunResult, ...]:
    """The adjacent splits (in prefill-count order) around `best` whose goodput is at least
    (1 - tolerance) of best's."""
    ordered = sorted(results, key=lambda r: r.n_prefill)
    floor = (1.0 - tolerance) * best.goodput_rps
    i = j = next(k for k, r in enumerate(ordered) if r is best)
    while i > 0 and ordered[i - 1].goodput_rps >= floor:
        i -= 1
    while j < len(ordered) - 1 and ordered[j + 1].goodput_rps >= floor:
        j += 1
    return tuple(ordered[i : j + 1])


def robust_point(flat: Sequence[RunResult]) -> RunResult:
    """The middle of a plateau; of two middles, the one with more goodput (then lower mean TTFT)."""
    if not flat:
        raise ValueError("empty plateau")
    mid = (len(flat) - 1) / 2
    middles = [flat[int(mid)], flat[int(mid + 0.5)]]
    return min(middles, key=lambda r: (-r.slo_met, r.ttft.mean, r.n_prefill))


def sweep(trace: str, nodes: int, spec: PolicySpec, args: argparse.Namespace, *, workers: int | None = None) -> SweepResult:
    """Simulate every split of `nodes` and pick the best."""
    if nodes < 2:
        raise ValueError("--nodes must be at least 2 (one prefill and one decode)")
    jobs = [SimJob(spec, config_from_args(args, p, nodes - p), trace, args.limit) for p in range(1, nodes)]
    results = tuple(run_jobs(jobs, workers=workers))
    best = recommend(results)
    flat = plateau(results, best)
    return SweepResult(nodes, results, best, flat, robust_point(flat))


def format_sweep(s: SweepResult) -> str:
    head = ("split", "goodput/s", "SLO met", "TTFT mean", "TTFT p90", "TBT mean", "TBT p90", "rejected", "")
    rows = [head]
    for r in s.results:
        flags = (("recommended", r is s.pick), ("best", r is s.best), ("plateau", any(r is x for x in s.plateau)))
        notes = [n for n, on in flags if on]
        rows.append(
            (
                f"{r.n_prefill}P:{r.n_decode}D",
                f"{r.goodput_rps:.3f}",
                f"{r.slo_attainment:.1%}",
                f"{r.ttft.mean:.2f}s",
                f"{r.ttft.p90:.2f}s",
                f"{r.tbt.mean * 1e3:.1f}ms",
                f"{r.tbt.p90 * 1e3:.1f}ms",
                str(r.rejected),
                ("<- " + ", ".join(notes)) if notes else "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    best, pick = s.best, s.pick
    if s.plateau:
        lo, hi = s.plateau[0], s.plateau[-1]
        lines.append(
            f"plateau (goodput within {PLATEAU_TOLERANCE:.0%} of the best, {best.n_prefill}P:{best.n_decode}D "
            f"at {best.goodput_rps:.3f} req/s): {lo.n_prefill}P:{lo.n_decode}D .. {hi.n_prefill}P:{hi.n_decode}D "
            f"({len(s.plateau)} split{'s' if len(s.plateau) > 1 else ''})"
        )
    lines.append(
        f"recommended: {pick.n_prefill} prefill + {pick.n_decode} decode "
        f"(goodput {pick.goodput_rps:.3f} req/s, mean TTFT {pick.ttft.mean:.2f}s, "
        f"mean TBT {pick.tbt.mean * 1e3:.1f}ms; the plateau's middle)"
    )
    return "\n".join(lines)


def write_plot(s: SweepResult, path: str | Path, title: str) -> bool:
    """Goodput, TTFT and TBT against the split; False (and a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[plot]' from the checkout); skipping the plot")
        return False
    xs = [r.n_prefill for r in s.results]
    labels = [f"{r.n_prefill}:{r.n_decode}" for r in s.results]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(xs, [r.goodput_rps for r in s.results], marker="o")
    if s.plateau:
        lo, hi = s.plateau[0].n_prefill, s.plateau[-1].n_prefill
        for ax in axes:
            ax.axvspan(lo - 0.3, hi + 0.3, color="green", alpha=0.1, label="plateau" if ax is axes[0] else None)
    axes[0].axvline(s.pick.n_prefill, color="green", linestyle="--", label="recommended")
    axes[0].set_ylabel("goodput (req/s)")
    axes[0].legend()
    slo_ttft, slo_tbt = s.best.slo_ttft_s, s.best.slo_tbt_s
    axes[1].plot(xs, [r.ttft.mean for r in s.results], marker="o", label="mean")
    axes[1].plot(xs, [r.ttft.p90 for r in s.results], marker="x", label="p90")
    if slo_ttft is not None:
        axes[1].axhline(slo_ttft, color="red", linestyle=":", label=f"SLO {slo_ttft:g} s")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].legend()
    axes[2].plot(xs, [r.tbt.mean * 1e3 for r in s.results], marker="o", label="mean")
    axes[2].plot(xs, [r.tbt.p90 * 1e3 for r in s.results], marker="x", label="p90")
    if slo_tbt is not None:
        axes[2].axhline(slo_tbt * 1e3, color="red", linestyle=":", label=f"SLO {slo_tbt * 1e3:g} ms")
    axes[2].set_ylabel("TBT (ms)")
    axes[2].set_xlabel("prefill : decode")
    axes[2].set_xticks(xs, labels, rotation=45)
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conductor tune-pd", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("trace", help="trace file or bundled name (conversation, synthetic, conversation-head400, tool-agent)")
    parser.add_argument("--nodes", type=int, required=True, help="total nodes to split into prefill and decode")
    parser.add_argument("--policy", default="round_robin", help="policy spec, name:key=value:...")
    parser.add_argument("--plot", default="tune-pd.png", help="PNG to write ('' for none)")
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write every split as JSON")
    parser.add_argument("--jobs", type=int, default=None, help="parallel simulations (default: one per core)")
    add_policy_args(parser)
    add_cluster_args(parser)
    return parser


def tune_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = resolve_trace(args.trace)
        load_requests(path, args.limit)  # fail fast, before starting workers
        (spec,) = apply_policy_args([PolicySpec.parse(args.policy)], args)
        result = sweep(str(path), args.nodes, spec, args, workers=args.jobs)
    except (ConductorError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{spec.label}; " + describe(config_from_args(args, 1, args.nodes - 1)).split(", ", 1)[1])
    print(format_sweep(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result.as_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")
    if args.plot:
        title = f"{Path(args.trace).name}: {args.nodes} nodes, {spec.label}, --pull {args.pull}"
        if write_plot(result, args.plot, title):
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(tune_main())
