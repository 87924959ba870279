"""`conductor tune-pd TRACE --nodes N`: sweep every P:D split of N nodes and recommend one.

    conductor tune-pd synthetic --nodes 16 --slo-ttft 10 --slo-tbt 0.1 --paper --speedup 2

Every split 1..N-1 prefill nodes is simulated (in parallel, one process per core) with the same
policy, trace and truth model. The recommended split has the highest goodput (requests per second
meeting both SLOs); ties go to the lower mean TTFT. A PNG of goodput, TTFT and TBT against the
split is written when matplotlib (the `plot` extra) is installed.
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
from traces.sim.options import add_cluster_args, config_from_args
from traces.sim.results import RunResult
from traces.sim.runner import PolicySpec, SimJob, load_requests, run_jobs


@dataclass(frozen=True, slots=True)
class SweepResult:
    """Every split's result, in prefill-count order, and the recommended one."""

    nodes: int
    results: tuple[RunResult, ...]
    best: RunResult

    def as_dict(self) -> dict[str, object]:
        return {
            "nodes": self.nodes,
            "recommended": {"prefill": self.best.n_prefill, "decode": self.best.n_decode},
            "results": [r.as_dict() for r in self.results],
        }


def recommend(results: Sequence[RunResult]) -> RunResult:
    """Max goodput; ties (same number of requests meeting both SLOs) broken by lower mean TTFT."""
    if not results:
        raise ValueError("no sweep results to recommend from")
    return min(results, key=lambda r: (-r.slo_met, r.ttft.mean, r.n_prefill))


def sweep(trace: str, nodes: int, spec: PolicySpec, args: argparse.Namespace, *,
          workers: int | None = None) -> SweepResult:
    """Simulate every split of `nodes` and pick the best."""
    if nodes < 2:
        raise ValueError("--nodes must be at least 2 (one prefill and one decode)")
    jobs = [SimJob(spec, config_from_args(args, p, nodes - p), trace, args.limit) for p in range(1, nodes)]
    results = tuple(run_jobs(jobs, workers=workers))
    return SweepResult(nodes, results, recommend(results))


def format_sweep(s: SweepResult) -> str:
    head = ("split", "goodput/s", "SLO met", "TTFT mean", "TTFT p90", "TBT mean", "TBT p90", "rejected", "")
    rows = [head]
    for r in s.results:
        rows.append((
            f"{r.n_prefill}P:{r.n_decode}D", f"{r.goodput_rps:.3f}", f"{r.slo_attainment:.1%}",
            f"{r.ttft.mean:.2f}s", f"{r.ttft.p90:.2f}s", f"{r.tbt.mean * 1e3:.1f}ms", f"{r.tbt.p90 * 1e3:.1f}ms",
            str(r.rejected), "<- recommended" if r is s.best else "",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    best = s.best
    lines.append(f"recommended: {best.n_prefill} prefill + {best.n_decode} decode "
                 f"(goodput {best.goodput_rps:.3f} req/s, mean TTFT {best.ttft.mean:.2f}s, "
                 f"mean TBT {best.tbt.mean * 1e3:.1f}ms)")
    return "\n".join(lines)


def write_plot(s: SweepResult, path: str | Path, title: str) -> bool:
    """Goodput, TTFT and TBT against the split; False (and a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'conductor-scheduler[plot]'); skipping the plot")
        return False
    xs = [r.n_prefill for r in s.results]
    labels = [f"{r.n_prefill}:{r.n_decode}" for r in s.results]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(xs, [r.goodput_rps for r in s.results], marker="o")
    axes[0].axvline(s.best.n_prefill, color="green", linestyle="--", label="recommended")
    axes[0].set_ylabel("goodput (req/s)")
    axes[0].legend()
    axes[1].plot(xs, [r.ttft.mean for r in s.results], marker="o", label="mean")
    axes[1].plot(xs, [r.ttft.p90 for r in s.results], marker="x", label="p90")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].legend()
    axes[2].plot(xs, [r.tbt.mean * 1e3 for r in s.results], marker="o", label="mean")
    axes[2].plot(xs, [r.tbt.p90 * 1e3 for r in s.results], marker="x", label="p90")
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
    parser.add_argument("trace", help="trace file or bundled name (conversation, synthetic, conversation-head400)")
    parser.add_argument("--nodes", type=int, required=True, help="total nodes to split into prefill and decode")
    parser.add_argument("--policy", default="round_robin", help="policy spec, name:key=value:...")
    parser.add_argument("--plot", default="tune-pd.png", help="PNG to write ('' for none)")
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write every split as JSON")
    parser.add_argument("--jobs", type=int, default=None, help="parallel simulations (default: one per core)")
    add_cluster_args(parser)
    return parser


def tune_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = resolve_trace(args.trace)
        load_requests(path, args.limit)  # fail fast, before starting workers
        spec = PolicySpec.parse(args.policy)
        result = sweep(str(path), args.nodes, spec, args, workers=args.jobs)
    except (ConductorError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_sweep(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result.as_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")
    if args.plot:
        title = f"{Path(args.trace).name}: {args.nodes} nodes, {spec.label}, SLO TTFT {args.slo_ttft}s TBT {args.slo_tbt}s"
        if write_plot(result, args.plot, title):
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(tune_main())
