"""A live replay's results: each request's outcome, the summary (the simulator's RunResult, so both
print in the same table), and the tables printed from them.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from traces.live_client import HttpOutcome
from traces.sim.results import Dist, RunResult, render_table, summary_rows


@dataclass(frozen=True, slots=True)
class LiveOutcome:
    """What happened to one replayed request."""

    line: int  # trace line
    scheduled_s: float  # arrival after speed-up, seconds from replay start
    lag_s: float  # how late the client sent it (event-loop or concurrency-limit delay)
    prompt_tokens: int
    max_tokens: int
    http: HttpOutcome


@dataclass(frozen=True, slots=True)
class LiveResult:
    """A live replay: the summary (same type as the simulator's) and every request's outcome."""

    run: RunResult
    outcomes: tuple[LiveOutcome, ...]
    errors: Mapping[str, int] = field(default_factory=dict)  # error kind -> count (not 429s)

    def as_dict(self) -> dict[str, Any]:
        """The summary, the error kinds and one small record per request (no prompt tokens)."""
        requests = [
            {
                "line": o.line,
                "scheduled_s": round(o.scheduled_s, 6),
                "lag_s": round(o.lag_s, 6),
                "prompt_tokens": o.prompt_tokens,
                "max_tokens": o.max_tokens,
                "status": o.http.status,
                "http_status": o.http.http_status,
                "reason": o.http.reason,
                "ttft_s": o.http.ttft_s,
                "tbt_s": o.http.tbt_s,
                "chunks": o.http.chunks,
                "cached_tokens": o.http.cached_tokens,
                "elapsed_s": round(o.http.elapsed_s, 6),
                "message": o.http.message,
            }
            for o in self.outcomes
        ]
        return {"result": self.run.as_dict(), "errors": dict(self.errors), "requests": requests}


def _share(cached: float, total: float) -> float:
    return cached / total if total > 0 else 0.0


def summarize(
    outcomes: Sequence[LiveOutcome],
    *,
    label: str,
    n_prefill: int,
    n_decode: int,
    slo_ttft_s: float | None,
    slo_tbt_s: float | None,
    wall_s: float,
    gateway_cached: tuple[float, float] | None = None,
    predictions: Mapping[str, tuple[float, float]] | None = None,
    kv_index: Mapping[str, float] | None = None,
) -> LiveResult:
    """The RunResult of a set of outcomes; `gateway_cached` = (cached, computed) token deltas;
    `predictions` = component -> (samples, MAPE) as the gateway exports them."""
    ok = [o for o in outcomes if o.http.status == "ok"]
    ttfts = [o.http.ttft_s for o in ok if o.http.ttft_s is not None]
    tbts = [o.http.tbt_s for o in ok if o.http.tbt_s is not None]
    rejections = Counter(o.http.reason or "unknown" for o in outcomes if o.http.status == "rejected")
    errors = Counter(o.http.reason or "unknown" for o in outcomes if o.http.status == "error")
    met = sum(
        1
        for o in ok
        if (slo_ttft_s is None or (o.http.ttft_s is not None and o.http.ttft_s <= slo_ttft_s))
        and (slo_tbt_s is None or o.http.tbt_s is None or o.http.tbt_s <= slo_tbt_s)
    )
    arrivals = [o.scheduled_s for o in outcomes]
    duration = max(1e-3, (max(arrivals) - min(arrivals)) if arrivals else 0.0)
    ends = [o.scheduled_s + o.lag_s + o.http.elapsed_s for o in outcomes]
    makespan = (max(ends) - min(arrivals)) if arrivals else 0.0
    prompt_reported = sum(o.http.prompt_tokens or 0 for o in ok)
    client_share = _share(sum(o.http.cached_tokens or 0 for o in ok), prompt_reported)
    gateway_share = _share(gateway_cached[0], sum(gateway_cached)) if gateway_cached else None
    lags = Dist.of([o.lag_s for o in outcomes])
    extra: dict[str, float] = {
        "errors": float(sum(errors.values())),
        "client_cached_share": client_share,
        "client_lag_p99_s": lags.p99,
        "output_tokens": float(sum(o.http.chunks for o in ok)),
        "prompt_tokens_sent": float(sum(o.prompt_tokens for o in outcomes)),
        "hit_rate_from_gateway": 1.0 if gateway_share is not None else 0.0,
    }
    if gateway_share is not None:
        extra["gateway_cached_share"] = gateway_share
    extra.update(kv_index or {})
    for component, (samples, mape) in (predictions or {}).items():
        extra[f"gateway_{component}_mape"] = mape
        extra[f"gateway_{component}_samples"] = samples
    run = RunResult(
        policy=label,
        mode="live",
        n_prefill=n_prefill,
        n_decode=n_decode,
        requests=len(outcomes),
        completed=len(ok),
        rejected=sum(rejections.values()),
        rejections=dict(rejections),
        ttft=Dist.of(ttfts),
        tbt=Dist.of(tbts),
        slo_ttft_s=slo_ttft_s,
        slo_tbt_s=slo_tbt_s,
        slo_met=met,
        slo_attainment=met / len(outcomes) if outcomes else 0.0,
        goodput_rps=met / duration,
        duration_s=duration,
        makespan_s=makespan,
        prefix_hit_local=gateway_share if gateway_share is not None else client_share,
        wall_s=wall_s,
        extra=extra,
    )
    return LiveResult(run, tuple(outcomes), dict(errors))


def live_rows(result: LiveResult) -> list[tuple[str, str]]:
    """What only a live replay has, as (label, value): errors, the hit-rate source, the gateway's
    own KV index and prediction figures."""
    errs = ", ".join(f"{k}={v}" for k, v in sorted(result.errors.items())) or "-"
    extra = result.run.extra
    rows = [
        ("errors", f"{int(extra.get('errors', 0))} ({errs})"),
        ("prefix hit source", "gateway counters" if extra.get("hit_rate_from_gateway") else "client usage"),
        ("client send lag p99", f"{extra.get('client_lag_p99_s', 0.0) * 1000:.1f}ms"),
    ]
    if "gateway_kv_hash_agreement" in extra:
        rows.append(
            (
                "KV index pred./reported cached",
                f"{int(extra['gateway_kv_predicted_cached_tokens'])} / "
                f"{int(extra['gateway_kv_reported_cached_tokens'])} tokens "
                f"(agreement {extra['gateway_kv_hash_agreement']:.0%})",
            )
        )
    for component in ("ttft", "tbt"):  # the gateway's own error windows (its recent requests)
        if f"gateway_{component}_mape" in extra:
            rows.append(
                (
                    f"{component.upper()} pred. MAPE (gateway, n)",
                    f"{extra[f'gateway_{component}_mape']:.0%}, {int(extra[f'gateway_{component}_samples'])}",
                )
            )
    return rows


def print_live(result: LiveResult, out: IO[str] | None = None) -> None:
    """The simulator's table, then what only a live replay has: errors and both hit-rate sources."""
    print_comparison([result], out)


def print_comparison(results: Sequence[LiveResult], out: IO[str] | None = None) -> None:
    """Live runs side by side, one column each (the simulator's rows, then the live-only ones);
    with several runs, each one's goodput against the first's."""
    stream = out if out is not None else sys.stdout
    headers = ["", *(f"{r.run.policy} ({r.run.mode})" for r in results)]
    print(render_table(headers, [[*summary_rows(r.run), *live_rows(r)] for r in results]), file=stream)
    first = results[0].run
    for r in results[1:]:
        if r.run.goodput_rps > 0:
            print(f"goodput {first.policy} / {r.run.policy}: {first.goodput_rps / r.run.goodput_rps:.2f}x", file=stream)
        else:
            print(f"goodput {first.policy} / {r.run.policy}: {first.goodput_rps:.3f} req/s against none", file=stream)
