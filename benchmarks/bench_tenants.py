"""Priority classes and tenants under overload, live: Conductor against vllm-router (issue 37).

    python benchmarks/bench_tenants.py --quick --capacity 5   # ~6 minutes: one run, 15 s scenarios
    python benchmarks/bench_tenants.py --quick                # + the capacity sweep (~2 minutes more)
    python benchmarks/bench_tenants.py --json out.json        # medians of 3 runs, 40 s scenarios (~40 minutes)

Emulated vLLM workers (bench_live_vs_peers.py's, started by benchmarks/live_routers.py: mixed role,
KV events, the bundled profile times `--time-scale`, 6: 2 shared cores carry 4 workers and the load),
a two-class workload (benchmarks/tenants_load.py: `interactive`, urgent, short, tight SLOs; `batch`,
sheddable, long, loose SLOs; 30% urgent) from two tenants of equal weight, A and B.

1. Capacity: the highest rate of that mix (both tenants, `--sweep`) at which Conductor kvcache_aware
   WITHOUT admission answers >= `--capacity-met` of the requests within their class's SLOs (or
   `--capacity` given). Everything below is a multiple of it.
2. Scenarios, each on a fresh cluster: `1.5x` and `3x` (A and B each half of 1.5x / 3x capacity);
   `share` (A and B each at their fair share, half the capacity) and `flood` (A at its share, B at 10x
   its share): the tenant goal is A's attainment in `flood` against `share`.
3. Routers: Conductor kvcache_aware (predicted admission) with `priority.classes` and `auth.tenants`
   (each tenant's key; the class in `x-priority`), vllm-router round_robin and cache_aware (no classes
   and no tenants: what happens to the urgent class there is the comparison).

Conductor runs with the defaults a user gets: only `priority.classes` (each class's own SLO) and
`auth.tenants`, as docs/deploy.md shows. The knobs tuned by hand before class-aware admission are
flags, off by default: `--max-inflight` (limits.max_inflight_requests), `--sheddable-share`
(priority.sheddable_share), `--batch-admit F` (batch's Conductor SLO at F x the urgent one).

Per class and tenant: the share admitted (not a 429), SLO attainment among the admitted and over
everything sent (a 429 is a miss). Medians over `--repeat` runs, with min..max; router order
alternates per repeat. The box is shared: compare routers within one run, not across days.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.live_routers import MODEL, RouterSpec, scaled_params, start_router, start_workers, wait_up
from benchmarks.tenants_load import CLASSES, SHEDDABLE, URGENT, ClassShape, Score, drive, score, shapes, workload
from conductor.demo.cluster import ChildGroup, free_ports
from traces.sim.results import render_table

KEYS = {"A": "sk-tenant-a", "B": "sk-tenant-b"}
ROUTERS = (
    RouterSpec("conductor", "conductor", "kvcache_aware", "predicted"),
    RouterSpec("vllm-router rr", "vllm", "round_robin"),
    RouterSpec("vllm-router cache", "vllm", "cache_aware"),
)
CALIBRATE = RouterSpec("conductor (no admission)", "conductor", "kvcache_aware", "none")
# scenario -> tenant -> its rate as a multiple of the capacity
SCENARIOS: dict[str, dict[str, float]] = {
    "1.5x": {"A": 0.75, "B": 0.75},
    "3x": {"A": 1.5, "B": 1.5},
    "share": {"A": 0.5, "B": 0.5},
    "flood": {"A": 0.5, "B": 5.0},
}
# `flood` sends `share`'s workload: tenant A's requests (drawn first) are the very same in both, so
# A's loss is the flood's doing, not the draw's (with seeds of their own it moved +-5-10 points)
SEED_OF = {"flood": "share"}


def scenario_seed(name: str, rep: int) -> int:
    """The workload seed of scenario `name` in repeat `rep` (100 rep + the scenario's place)."""
    return 100 * rep + list(SCENARIOS).index(SEED_OF.get(name, name))


def conductor_settings(
    spec: RouterSpec, workers: dict[str, Any], args: argparse.Namespace, port: int, log_dir: Path
) -> dict[str, Any]:
    """The gateway's settings: the two classes with their SLOs, the two tenants with their keys."""
    classes = shapes(args.time_scale)
    options: dict[str, Any] = {"admission": spec.admission}
    if args.time_scale != 1.0:
        options["predictor_params"] = scaled_params(args.time_scale, log_dir)
    urgent, batch = classes[URGENT], classes[SHEDDABLE]
    if args.batch_admit > 0:  # admit batch by a fraction of the urgent SLO: onto idle capacity only
        batch = ClassShape(urgent.ttft_s * args.batch_admit, urgent.tbt_s * args.batch_admit, batch.prompt, batch.output)
    priority: dict[str, Any] = {
        "classes": {
            URGENT: {"slo": {"ttft_s": urgent.ttft_s, "tbt_s": urgent.tbt_s}, "rank": 0},
            SHEDDABLE: {"slo": {"ttft_s": batch.ttft_s, "tbt_s": batch.tbt_s}, "rank": 1, "sheddable": True},
        },
        "default": URGENT,
    }
    if args.sheddable_share is not None:
        priority["sheddable_share"] = args.sheddable_share
    out = {
        "host": "127.0.0.1",
        "port": port,
        "logs": {"level": args.log_level, "format": "json"},
        "policy": spec.policy,
        "policy_options": options,
        "models": [MODEL],
        **workers,
        "health": {"interval_s": 1.0},
        "block_size": 16,
        "slo": {"ttft_s": urgent.ttft_s, "tbt_s": urgent.tbt_s},
        "kv": {"enabled": True, "tokenizer": "builtin"},
        "priority": priority,
        "auth": {"tenants": {t: {"api_keys": [k], "weight": 1} for t, k in KEYS.items()}, "public_metrics": True},
    }
    if args.max_inflight is not None:
        out["limits"] = {"max_inflight_requests": args.max_inflight}
    return out


def start(group: ChildGroup, spec: RouterSpec, args: argparse.Namespace, log_dir: Path) -> str:
    """Fresh workers and the router in front of them, ready; the router's URL."""
    workers = start_workers(group, args.workers, args)
    checks = [f"{w['url']}/health" for ws in workers.values() for w in ws]
    if spec.kind == "vllm":
        url, ready = start_router(group, spec, workers, args, log_dir)
    else:
        (port,) = free_ports(1)
        url, ready = f"http://127.0.0.1:{port}", "/ready"
        config = log_dir / "gateway.yaml"
        config.write_text(json.dumps(conductor_settings(spec, workers, args, port, log_dir)), encoding="utf-8")
        group.start("router", [sys.executable, "-m", "conductor", "serve", "--config", str(config)])
    wait_up(group, [*checks, url + ready])
    if spec.kind == "conductor":  # /ready comes before the KV events flow
        time.sleep(1.0)
    return url


def run_scenario(url: str, rates: Mapping[str, float], args: argparse.Namespace, seed: int) -> dict[str, Score]:
    classes = shapes(args.time_scale)
    requests = workload(rates, args.urgent_fraction, args.duration, classes, seed)
    return score(asyncio.run(drive(url, MODEL, requests, KEYS)), classes)


def calibrate(args: argparse.Namespace, log_root: Path) -> float:
    """The highest `--sweep` rate whose mix Conductor without admission serves within SLO."""
    log_dir = Path(tempfile.mkdtemp(prefix="calibrate-", dir=log_root))
    group = ChildGroup(log_dir)
    best = 0.0
    try:
        url = start(group, CALIBRATE, args, log_dir)
        for i, rate in enumerate(float(x) for x in args.sweep.split(",")):
            met = run_scenario(url, {"A": rate / 2, "B": rate / 2}, args, seed=1000 + i)["all"].met_sent
            print(f"  calibrate {rate:g} req/s: {met:.1%} within SLO", file=sys.stderr, flush=True)
            if met < args.capacity_met:
                break
            best = rate
    finally:
        group.stop()
    if best == 0.0:
        raise SystemExit(f"even the lowest --sweep rate misses {args.capacity_met:.0%}: lower it")
    return best


def run_router(
    spec: RouterSpec, capacity: float, args: argparse.Namespace, log_root: Path, rep: int
) -> dict[str, dict[str, Any]]:
    """Every scenario, each on a fresh cluster (kvcache_aware's predictors learn online: one
    scenario's overload must not carry into the next): scenario -> group -> its score (as a dict)."""
    out: dict[str, dict[str, Any]] = {}
    for name, multiples in SCENARIOS.items():
        if name not in args.scenarios:
            continue
        log_dir = Path(tempfile.mkdtemp(prefix=f"{spec.name.replace(' ', '-')}-{name}-", dir=log_root))
        group = ChildGroup(log_dir)
        try:
            url = start(group, spec, args, log_dir)
            started = time.monotonic()
            rates = {t: m * capacity for t, m in multiples.items()}
            scores = run_scenario(url, rates, args, seed=scenario_seed(name, rep))
            dead = group.dead()
            if dead:
                raise RuntimeError(f"{dead[0].name} died:\n{dead[0].log_tail()}")
        finally:
            group.stop()
        out[name] = {g: s.as_dict() for g, s in scores.items()}
        _progress(name, spec.name, scores, time.monotonic() - started)
    return out


def _progress(scenario: str, router: str, scores: Mapping[str, Score], took_s: float) -> None:
    u, b = scores[f"class:{URGENT}"], scores[f"class:{SHEDDABLE}"]
    print(
        f"  {scenario:<6} {router:<18} urgent adm {u.admitted_share:.0%} met/adm {u.met_admitted:.1%} "
        f"| batch adm {b.admitted_share:.0%} met/adm {b.met_admitted:.1%} "
        f"| A met {scores['tenant:A'].met_sent:.1%} B met {scores['tenant:B'].met_sent:.1%} ({took_s:.0f}s) "
        f"urgent missed {u.reasons} batch missed {b.reasons}",
        file=sys.stderr,
        flush=True,
    )


ROWS = (
    (f"class:{URGENT}", "urgent"),
    (f"class:{SHEDDABLE}", "batch"),
    ("tenant:A", "tenant A"),
    ("tenant:B", "tenant B"),
    (f"tenant:A/{URGENT}", "A urgent"),
    (f"tenant:A/{SHEDDABLE}", "A batch"),
)
METRICS = (("admitted_share", "admitted"), ("met_admitted", "met/admitted"), ("met_sent", "met/sent"))


def _cell(values: Sequence[float]) -> str:
    mid = statistics.median(values)
    return f"{mid:.1%}" + (f" [{min(values):.0%}..{max(values):.0%}]" if len(values) > 1 else "")


def _values(runs: Sequence[dict[str, dict[str, Any]]], scenario: str, group: str, metric: str) -> list[float]:
    return [float(r[scenario][group][metric]) for r in runs if group in r[scenario]]


def table(scenario: str, cells: Mapping[str, Sequence[dict[str, dict[str, Any]]]]) -> str:
    columns = []
    for runs in cells.values():
        rows = []
        for group, label in ROWS:
            for metric, mlabel in METRICS:
                values = _values(runs, scenario, group, metric)
                if values:
                    rows.append((f"{label} {mlabel}", _cell(values)))
        columns.append(rows)
    return render_table([scenario, *cells], columns)


def goals(cells: Mapping[str, Sequence[dict[str, dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per router, the issue's figures: at 3x the urgent class's attainment among its admitted and
    the two classes' admitted shares; the batch class admitted at 1x (`share`); tenant A's attainment
    over all sent, `share` minus `flood`. A figure whose scenario was not run is NaN."""
    out = {}
    for name, runs in cells.items():
        med = {
            key: statistics.median(_values(runs, scenario, group, metric)) if all(scenario in r for r in runs) else math.nan
            for key, (scenario, group, metric) in {
                "urgent_met_admitted_3x": ("3x", f"class:{URGENT}", "met_admitted"),
                "urgent_admitted_3x": ("3x", f"class:{URGENT}", "admitted_share"),
                "batch_admitted_3x": ("3x", f"class:{SHEDDABLE}", "admitted_share"),
                "urgent_met_sent_3x": ("3x", f"class:{URGENT}", "met_sent"),
                "batch_admitted_1x": ("share", f"class:{SHEDDABLE}", "admitted_share"),
            }.items()
        }
        both = [r for r in runs if "flood" in r and "share" in r]
        drops = [100 * (r["share"]["tenant:A"]["met_sent"] - r["flood"]["tenant:A"]["met_sent"]) for r in both]
        med["tenant_A_drop_points"] = statistics.median(drops) if drops else math.nan
        out[name] = {**med, "tenant_A_drop_points_runs": [round(d, 1) for d in drops]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="emulated workers per cluster")
    ap.add_argument("--time-scale", type=float, default=6.0, help="multiply the workers' modelled durations (and the SLOs)")
    ap.add_argument("--noise", type=float, default=0.05, help="workers' timing noise (lognormal sigma)")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per scenario")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--urgent-fraction", type=float, default=0.3, help="share of requests that are interactive")
    ap.add_argument("--capacity", type=float, default=None, help="req/s of the mix the cluster serves (skips the sweep)")
    ap.add_argument("--sweep", default="3,4,5,6,7", help="rates tried for the capacity, ascending")
    ap.add_argument("--capacity-met", type=float, default=0.95, help="share within SLO that counts as served")
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="Conductor's limits.max_inflight_requests (default: the gateway's own, 4096)",
    )
    ap.add_argument("--sheddable-share", type=float, default=None, help="Conductor's priority.sheddable_share (default: its own)")
    ap.add_argument(
        "--batch-admit",
        type=float,
        default=0.0,
        help="Conductor judges batch requests by this fraction of the urgent SLOs (0: by batch's own); the "
        "client always scores batch by its own",
    )
    ap.add_argument("--routers", default=",".join(s.name for s in ROUTERS), help="comma-separated router names")
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router") or "/tmp/vr-venv/bin/vllm-router")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated scenarios to run (all by default)")
    ap.add_argument(
        "--keep-logs",
        default=None,
        help="a folder to keep each cluster's logs in (with --log-level info the gateway's decision log)",
    )
    ap.add_argument("--log-level", default="warning", help="the gateway's log level (info writes the decision log)")
    ap.add_argument("--quick", action="store_true", help="one run, 15 s scenarios, a short sweep (~3 minutes)")
    args = ap.parse_args(argv)
    args.shape = "mixed"  # start_workers' and start_router's argument
    if args.quick:
        args.repeat, args.duration = 1, 15.0
    wanted = {n.strip() for n in args.routers.split(",")}
    specs = [s for s in ROUTERS if s.name in wanted and (s.kind != "vllm" or Path(args.vllm_router).exists())]
    args.scenarios = {n.strip() for n in args.scenarios.split(",")}
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
    kept = contextlib.nullcontext(args.keep_logs) if args.keep_logs else tempfile.TemporaryDirectory(prefix="bench-tenants-")
    with kept as tmp:
        capacity = args.capacity or calibrate(args, Path(tmp))
        print(f"capacity {capacity:g} req/s ({args.workers} workers, time scale {args.time_scale:g})", file=sys.stderr)
        cells: dict[str, list[dict[str, dict[str, Any]]]] = {s.name: [] for s in specs}
        for rep in range(args.repeat):
            for spec in specs if rep % 2 == 0 else specs[::-1]:
                cells[spec.name].append(run_router(spec, capacity, args, Path(tmp), rep))
    classes = shapes(args.time_scale)
    slos = ", ".join(f"{c} TTFT {classes[c].ttft_s:g}s TBT {classes[c].tbt_s:g}s" for c in CLASSES)
    print(f"capacity {capacity:g} req/s; {slos}; urgent share {args.urgent_fraction:g}; {args.repeat} run(s)")
    for scenario in SCENARIOS:
        if scenario in args.scenarios:
            print("\n" + table(scenario, cells))
    found = goals(cells)
    print()
    for name, g in found.items():
        print(
            f"{name}: 3x urgent met/admitted {g['urgent_met_admitted_3x']:.1%} (goal >= 99%), admitted urgent "
            f"{g['urgent_admitted_3x']:.0%} vs batch {g['batch_admitted_3x']:.0%}; tenant A loses "
            f"{g['tenant_A_drop_points']:.1f} points to B's flood (goal <= 5; runs {g['tenant_A_drop_points_runs']}); "
            f"batch admitted at 1x {g['batch_admitted_1x']:.0%}"
        )
    if args.json_out:
        out = {
            "settings": {**vars(args), "scenarios": sorted(args.scenarios)},
            "capacity_rps": capacity,
            "scenarios": SCENARIOS,
            "runs": cells,
            "goals": found,
        }
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
