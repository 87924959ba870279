"""Capacity at SLO (issue 39): the highest request rate at which at least 90% of the requests meet
both SLOs, read off attainment-against-rate curves; the maths, the tables and the plot of
bench_live_vs_peers.py --capacity, kept free of the clusters so they can be tested on their own.

A curve holds, per rate, the attainment (met / sent: a 429 or an error is a miss) of every run.
The capacity is interpolated linearly between the highest rate whose attainment is at or above the
target and the next rate (below it, by construction); a curve that never drops below the target
only says the capacity is at least its highest rate (">="), one that starts below it only that the
capacity is under its lowest ("<"). The spread is the same reading done on each run index alone
(run j of every rate: one sweep, measured close together in time), min..max over the indices.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

TARGET = 0.9
_ORDER = {"<": -1, "=": 0, ">=": 1}  # at the same rate: under it, at it, at least it


@dataclass(frozen=True, slots=True)
class Capacity:
    """A rate read off a curve; `bound` "=" a crossing, ">=" never crossed, "<" below from the start."""

    rate: float
    bound: str = "="

    def key(self) -> tuple[float, int]:
        return (self.rate, _ORDER[self.bound])

    def text(self, digits: int = 2) -> str:
        if self.bound == "=":
            return f"{self.rate:.{digits}f}"
        return f"{self.bound}{round(self.rate, digits):g}"


def crossing(rates: Sequence[float], attainment: Sequence[float], target: float = TARGET) -> Capacity:
    """Where the curve (`attainment` at `rates`, any order, no rate twice) leaves `target`."""
    if len(rates) != len(attainment) or not rates:
        raise ValueError(f"need one attainment per rate, got {len(attainment)} for {len(rates)} rates")
    if len(set(rates)) != len(rates):
        raise ValueError(f"a rate appears twice in {list(rates)}")
    points = sorted(zip(rates, attainment, strict=True))
    met = [i for i, (_, a) in enumerate(points) if a >= target]
    if not met:
        return Capacity(points[0][0], "<")
    last = met[-1]  # the highest rate still at the target: a dip below it at a lower rate is noise
    if last == len(points) - 1:
        return Capacity(points[-1][0], ">=")
    (r1, a1), (r2, a2) = points[last], points[last + 1]
    return Capacity(r1 + (a1 - target) * (r2 - r1) / (a1 - a2))  # a1 >= target > a2


def ratio_text(num: Capacity, den: Capacity) -> str:
    """num / den, with the direction a censored side leaves the ratio known in ("?" when none)."""
    if den.rate <= 0:
        return "?"
    value = f"{num.rate / den.rate:.2f}x"
    if num.bound == "=" and den.bound == "=":
        return value
    if num.bound in ("=", ">=") and den.bound in ("=", "<"):
        return ">=" + value  # the numerator can only be higher, the denominator only lower
    if num.bound in ("=", "<") and den.bound in ("=", ">="):
        return "<=" + value
    return "?"


@dataclass(frozen=True, slots=True)
class Curve:
    """One router's sweep: `runs[i]` the attainments of every run at `rates[i]`, in run order."""

    rates: tuple[float, ...]
    runs: tuple[tuple[float, ...], ...]

    def median(self) -> list[float]:
        return [statistics.median(r) for r in self.runs]

    def band(self) -> list[tuple[float, float]]:
        return [(min(r), max(r)) for r in self.runs]

    def capacity(self, target: float = TARGET) -> Capacity:
        """Read off the median curve."""
        return crossing(self.rates, self.median(), target)

    def per_run(self, target: float = TARGET) -> list[Capacity]:
        """Read off each run index's own curve (indices every rate has)."""
        n = min(len(r) for r in self.runs)
        return [crossing(self.rates, [r[j] for r in self.runs], target) for j in range(n)]

    def spread(self, target: float = TARGET) -> tuple[Capacity, Capacity]:
        each = sorted(self.per_run(target), key=Capacity.key)
        return each[0], each[-1]


def best_peer(curves: Mapping[str, Curve], peers: Sequence[str], target: float = TARGET) -> str | None:
    found = [n for n in peers if n in curves]
    return max(found, key=lambda n: curves[n].capacity(target).key()) if found else None


def paired_ratios(a: Curve, b: Curve, target: float = TARGET) -> list[float] | None:
    """a / b per run index (runs j measured in the same sweep); None when any side is censored."""
    pairs = list(zip(a.per_run(target), b.per_run(target), strict=False))
    if not pairs or any(x.bound != "=" or y.bound != "=" or y.rate <= 0 for x, y in pairs):
        return None
    return [x.rate / y.rate for x, y in pairs]


def capacity_rows(
    curves: Mapping[str, Curve], peers: Sequence[str], base_rps: float, target: float = TARGET
) -> tuple[list[str], list[list[str]], str | None]:
    """(headers, rows, best peer): a row per rate (median attainment, min..max), then the capacity
    as a speed-up, its spread, as requests per second, and its ratio to the best peer's."""
    names = list(curves)
    rates = sorted({r for c in curves.values() for r in c.rates})
    rows = []
    for rate in rates:
        row = [f"{rate:g}x ({rate * base_rps:.1f} req/s)"]
        for n in names:
            c = curves[n]
            if rate not in c.rates:
                row.append("-")
                continue
            i = c.rates.index(rate)
            lo, hi = c.band()[i]
            spread = f" ({lo:.0%}..{hi:.0%})" if len(c.runs[i]) > 1 else ""
            row.append(f"{c.median()[i]:.0%}{spread}")
        rows.append(row)
    caps = {n: curves[n].capacity(target) for n in names}
    spreads = {n: curves[n].spread(target) for n in names}
    rows.append([f"capacity at {target:.0%} (speed-up)", *(caps[n].text() for n in names)])
    rows.append(["min..max over run indices", *(f"{spreads[n][0].text()}..{spreads[n][1].text()}" for n in names)])
    rows.append(
        ["capacity, req/s", *(Capacity(caps[n].rate * base_rps, caps[n].bound).text(1) for n in names)],
    )
    best = best_peer(curves, peers, target)
    if best is not None:
        cells = []
        for n in names:
            paired = paired_ratios(curves[n], curves[best], target)
            extra = f" ({min(paired):.2f}..{max(paired):.2f})" if paired and len(paired) > 1 else ""
            cells.append(ratio_text(caps[n], caps[best]) + extra)
        rows.append([f"/ best peer ({best})", *cells])
    return ["speed-up (rate)", *names], rows, best


def markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub table (docs/benchmarks.md's kind)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def curves_from_runs(by_rate: Mapping[str, Mapping[str, Any]]) -> dict[str, Curve]:
    """Curves from the JSON's "rates" (rate -> {"runs": router -> [run summaries]}), to redraw a
    table from a saved run; a router's curve keeps the rates it has runs at."""
    points: dict[str, dict[float, tuple[float, ...]]] = {}
    for rate, cell in by_rate.items():
        for name, runs in cell["runs"].items():
            if runs:
                points.setdefault(name, {})[float(rate)] = tuple(float(r["slo_attainment"]) for r in runs)
    return {name: Curve(tuple(sorted(at)), tuple(at[r] for r in sorted(at))) for name, at in points.items() if at}


def plot(curves: Mapping[str, Curve], path: Path, title: str, base_rps: float, target: float = TARGET) -> None:
    """Attainment against rate, one line per router (median, min..max shaded), the target dashed
    and each capacity marked; matplotlib imported here, so only --plot needs it."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark box
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, c in curves.items():
        rps = [r * base_rps for r in c.rates]
        (line,) = ax.plot(rps, [100 * a for a in c.median()], marker="o", label=f"{name} ({c.capacity(target).text()}x)")
        lows, highs = zip(*c.band(), strict=True)
        ax.fill_between(rps, [100 * a for a in lows], [100 * a for a in highs], color=line.get_color(), alpha=0.18)
        cap = c.capacity(target)
        if cap.bound == "=":
            ax.plot([cap.rate * base_rps], [100 * target], marker="x", markersize=10, color=line.get_color())
    ax.axhline(100 * target, linestyle="--", color="grey", linewidth=1)
    ax.set_xlabel("offered load, requests/s (trace arrivals sped up)")
    ax.set_ylabel("SLO attainment, % of requests sent (TTFT and TBT met)")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8)
    if base_rps > 0:  # the same axis as the speed-ups the table is in

        def speed_up(x: Any) -> Any:  # numpy arrays in, numpy arrays out
            return x / base_rps

        def to_rps(x: Any) -> Any:
            return x * base_rps

        top = ax.secondary_xaxis("top", functions=(speed_up, to_rps))
        top.set_xlabel("speed-up of the trace's arrivals", fontsize=8)
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates) or len(set(rates)) != len(rates):
        raise SystemExit(f"--rates: distinct positive speed-ups, comma-separated, not {text!r}")
    return rates


class Named(Protocol):
    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)


def sweep(
    routers: Sequence[N], rates: Sequence[float], repeat: int, measure: Callable[[N, float], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`repeat` full sweeps of `measure(router, rate)` (a run's JSON record, with "slo_attainment"),
    as the JSON keeps them: rate -> {"runs": router -> [records in sweep order]}. Each sweep reverses
    the router order and the rate order of the one before, so neither a router nor a rate always
    runs first or last while a shared box's load drifts; run j of every rate is sweep j."""
    ordered = sorted(rates)
    out: dict[str, dict[str, Any]] = {f"{r:g}": {"runs": {}} for r in ordered}
    for rep in range(repeat):
        for rate in ordered if rep % 2 == 0 else ordered[::-1]:
            for router in routers if rep % 2 == 0 else routers[::-1]:
                out[f"{rate:g}"]["runs"].setdefault(router.name, []).append(measure(router, rate))
    return out


def report(out: Mapping[str, Any], columns: Sequence[str], peers: Sequence[str], plot_path: str | None) -> None:
    """Print the header, the markdown table (routers in `columns` order, others after) and what was
    left out, from `out` as bench_live_vs_peers.py --json writes it; draw the plot if asked."""
    curves = curves_from_runs(out["rates"])
    ordered = {n: curves[n] for n in [*(c for c in columns if c in curves), *(n for n in curves if n not in columns)]}
    headers, rows, _ = capacity_rows(ordered, peers, out["base_rps"])
    print("\n".join(out["header"]))
    print(markdown(headers, rows))
    for name, why in out.get("missing", {}).items():
        print(f"- {name}: left out: {why}")
    if plot_path:
        plot(ordered, Path(plot_path), out["header"][0], out["base_rps"])
        print(f"plot: {plot_path}")
