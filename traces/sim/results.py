"""Results of one replay (simulated or live): distributions, SLO attainment, goodput, hit rates.

The same `RunResult` and `format_table` serve the simulator and the live replay so both print the
same summary table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Dist:
    """Summary of a latency distribution in seconds; zeros when there were no samples."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: Sequence[float]) -> Dist:
        if not values:
            return Dist(0, 0.0, 0.0, 0.0, 0.0)
        s = sorted(values)
        n = len(s)

        def pct(q: float) -> float:  # nearest-rank percentile
            return s[min(n - 1, max(0, math.ceil(q * n) - 1))]

        return Dist(n, math.fsum(s) / n, pct(0.50), pct(0.90), pct(0.99))


@dataclass(frozen=True, slots=True)
class PredictionError:
    """How far the policy's predictions were from what happened (requests it predicted for)."""

    count: int
    mean_abs_s: float
    mean_rel: float  # mean of |predicted - actual| / actual
    bias_s: float  # mean of predicted - actual (negative: optimistic)

    @staticmethod
    def of(pairs: Sequence[tuple[float, float]]) -> PredictionError:
        pairs = [(p, a) for p, a in pairs if a > 0]
        if not pairs:
            return PredictionError(0, 0.0, 0.0, 0.0)
        n = len(pairs)
        return PredictionError(
            n,
            math.fsum(abs(p - a) for p, a in pairs) / n,
            math.fsum(abs(p - a) / a for p, a in pairs) / n,
            math.fsum(p - a for p, a in pairs) / n,
        )


@dataclass(frozen=True, slots=True)
class RunResult:
    """What one replay of a trace through one policy produced."""

    policy: str
    mode: str  # "simulate" or "live"
    n_prefill: int
    n_decode: int
    requests: int  # requests in the (limited) trace
    completed: int  # finished with a first token and all output
    rejected: int
    rejections: Mapping[str, int]  # reason -> count
    ttft: Dist  # over completed requests
    tbt: Dist  # per-request mean time between tokens, over completed requests with > 1 token
    slo_ttft_s: float | None
    slo_tbt_s: float | None
    slo_met: int  # completed and meeting both SLOs
    slo_attainment: float  # slo_met / requests (rejected count as missed)
    goodput_rps: float  # slo_met / replay duration
    duration_s: float  # first to last arrival, after speedup (at least 1 ms)
    makespan_s: float  # first arrival to last completion
    prefix_hit_local: float = 0.0  # share of prompt tokens reused from the prefill's own cache
    prefix_hit_remote: float = 0.0  # share pulled from another prefill instance
    prefix_hit_store: float = 0.0  # share pulled from the Mooncake Store pool
    utilisation: Mapping[str, float] = field(default_factory=dict)  # instance -> busy share of makespan
    ttft_prediction: PredictionError = PredictionError(0, 0.0, 0.0, 0.0)
    tbt_prediction: PredictionError = PredictionError(0, 0.0, 0.0, 0.0)
    wall_s: float = 0.0  # how long the replay itself took
    extra: Mapping[str, float] = field(default_factory=dict)  # mode-specific figures
    # per priority class and tenant (traces/sim/groups.py): "class:<c>", "tenant:<t>", "tenant:<t>/<c>",
    # "all" -> sent, admitted, met, admitted_share, met_admitted, met_sent, missed:<why>; empty without classes
    groups: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)


def _fmt_s(x: float) -> str:
    return f"{x * 1000:.1f}ms" if x < 1 else f"{x:.2f}s"


def _spread(values: Iterable[float]) -> str:
    vals = list(values)
    return f"{min(vals):.0%} / {sum(vals) / len(vals):.0%} / {max(vals):.0%}" if vals else "-"


def summary_rows(r: RunResult) -> list[tuple[str, str]]:
    """(label, value) pairs of the summary table for one result."""
    rej = ", ".join(f"{k}={v}" for k, v in sorted(r.rejections.items())) or "-"
    return [
        ("cluster", f"{r.n_prefill}P{r.n_decode}D" if r.n_prefill else f"{r.n_decode} mixed"),
        ("requests", str(r.requests)),
        ("completed", str(r.completed)),
        ("rejected", f"{r.rejected} ({rej})"),
        ("TTFT mean", _fmt_s(r.ttft.mean)),
        ("TTFT p50/p90/p99", f"{_fmt_s(r.ttft.p50)} / {_fmt_s(r.ttft.p90)} / {_fmt_s(r.ttft.p99)}"),
        ("TBT mean", _fmt_s(r.tbt.mean)),
        ("TBT p50/p90/p99", f"{_fmt_s(r.tbt.p50)} / {_fmt_s(r.tbt.p90)} / {_fmt_s(r.tbt.p99)}"),
        ("SLO (TTFT, TBT)", f"{r.slo_ttft_s}s, {r.slo_tbt_s}s"),
        ("SLO met", f"{r.slo_met} ({r.slo_attainment:.1%})"),
        ("goodput", f"{r.goodput_rps:.3f} req/s"),
        ("prefix hit local/remote/store", f"{r.prefix_hit_local:.1%} / {r.prefix_hit_remote:.1%} / {r.prefix_hit_store:.1%}"),
        ("prefill util. min/mean/max", _spread(v for k, v in r.utilisation.items() if k.startswith("prefill"))),
        ("decode util. min/mean/max", _spread(v for k, v in r.utilisation.items() if k.startswith("decode"))),
        ("TTFT pred. error (n, mean abs, rel)", _prediction(r.ttft_prediction)),
        ("TBT pred. error (n, mean abs, rel)", _prediction(r.tbt_prediction)),
        ("wall time", f"{r.wall_s:.2f}s"),
        *_group_rows(r.groups),
    ]


def _group_rows(groups: Mapping[str, Mapping[str, float]]) -> list[tuple[str, str]]:
    """Per class, then per tenant: admitted share, SLO attainment among the admitted and over all sent."""
    rows = []
    for name in sorted(g for g in groups if g.startswith(("class:", "tenant:")) and "/" not in g):
        g = groups[name]
        rows.append(
            (
                f"{name} admitted, met/admitted, met/sent",
                f"{g['admitted_share']:.1%}, {g['met_admitted']:.1%}, {g['met_sent']:.1%} (of {int(g['sent'])})",
            )
        )
    return rows


def _prediction(e: PredictionError) -> str:
    return f"{e.count}, {_fmt_s(e.mean_abs_s)}, {e.mean_rel:.0%}" if e.count else "-"


def format_table(results: Sequence[RunResult]) -> str:
    """The results side by side: one column per policy, one row per figure; a row no result has a
    figure for (utilisation and prediction error in a live replay) is left out."""
    if not results:
        return "(no results)"
    return render_table(["", *(f"{r.policy} ({r.mode})" for r in results)], [summary_rows(r) for r in results])


def render_table(headers: Sequence[str], columns: Sequence[Sequence[tuple[str, str]]]) -> str:
    """Columns of (label, value) rows side by side under `headers` (the first names the labels);
    rows in the order labels first appear, "-" where a column lacks one, rows with none left out."""
    labels = list(dict.fromkeys(label for col in columns for label, _ in col))
    values = [dict(col) for col in columns]
    cells = [[label, *(v.get(label, "-") for v in values)] for label in labels]
    cells = [row for row in cells if any(value != "-" for value in row[1:])]
    headers = list(headers)
    widths = [max(len(row[j]) for row in [headers, *cells]) for j in range(len(headers))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def result_from_dict(d: Mapping[str, Any]) -> RunResult:
    """Inverse of RunResult.as_dict (for results read back from --json files or worker processes)."""
    fields = dict(d)
    fields["ttft"] = Dist(**d["ttft"])
    fields["tbt"] = Dist(**d["tbt"])
    fields["ttft_prediction"] = PredictionError(**d["ttft_prediction"])
    fields["tbt_prediction"] = PredictionError(**d["tbt_prediction"])
    return RunResult(**fields)
