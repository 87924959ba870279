"""Priority classes and tenants under overload, simulated: benchmarks/bench_tenants.py's scenarios on
the trace simulator (issue 37, "simulator the same within 10%").

    python benchmarks/bench_sim_tenants.py --capacity 5                    # 4 seeds, 40 s scenarios (~10 s)
    python benchmarks/bench_sim_tenants.py                                 # the capacity swept first, as live
    python benchmarks/bench_sim_tenants.py --capacity 5 --live live.json   # beside a bench_tenants.py --json run

The same workload (benchmarks/tenants_load.py's `workload`, the same seeds: scenario i of repeat r is
bench_tenants.scenario_seed, as bench_tenants.py sends it), made a trace by traces/prompt_trace.py (16-token
blocks named by content, so each tenant's system prompt is a shared prefix), on a simulated cluster
matching bench_tenants.py's: 4 mixed workers (`SimConfig.mixed`), timed by the emulators' own profile
times `--time-scale` (traces.sim.truth.truth_from_emulator), lognormal noise `--noise` (seed r).
Conductor's settings are bench_tenants.py's own (`conductor_settings`): the same `priority.classes`,
`auth.tenants`, `limits` and kvcache_aware options (its predictor params scaled like the workers),
run by the gateway's code (benchmarks/sim_gateway_classes.py: its Classifier, its in-flight Shares,
the policy told the ClassRules).

Capacity: `--capacity` (the live runs' 5 req/s, docs/benchmarks.md), else swept as bench_tenants.py
does (Conductor without admission, the highest `--sweep` rate meeting `--capacity-met`).

Also `trickle` (simulated only): A at 0.05x its share beside B at 10x, with and without the share
rule: the fleet's met share of all sent, which a work-conserving share rule keeps (fairness.py).

Prints bench_tenants.py's tables (medians over the seeds, [min..max]) and its goal line; with `--live`
the live run's columns beside the simulated one and each goal figure's sim - live difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.emulator.profile import load_profile
from benchmarks.bench_tenants import CALIBRATE, ROUTERS, SCENARIOS, conductor_settings, goals, scenario_seed, table
from benchmarks.sim_gateway_classes import sim_classes
from benchmarks.tenants_load import CLASSES, URGENT, shapes, workload
from conductor.core.classes import ClassRules
from conductor.core.types import Policy, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.kvcache_aware.fairness import TENANT_SHARE
from traces.prompt_trace import prompt_trace
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.results import RunResult
from traces.sim.runner import PolicySpec, build_policy
from traces.sim.truth import truth_from_emulator

SIM_COLUMN = "conductor (sim)"
# a trickle beside a flood (simulated only): A at 0.05x its share (half the capacity), B at 10x; a
# work-conserving share rule leaves B what A does not use (fairness.py)
TRICKLE = {"A": 0.025, "B": 5.0}
CONDUCTOR = next(s for s in ROUTERS if s.kind == "conductor")


def simulate_scenario(
    rates: Mapping[str, float], seed: int, noise_seed: int, admission: str, args: argparse.Namespace, share: bool = True
) -> RunResult:
    """One scenario on a fresh simulated cluster (fresh predictors, as live on a fresh cluster);
    `share` False: the policy without its tenant-share rule (fairness.py), the classes kept."""
    spec = CONDUCTOR if admission == CONDUCTOR.admission else CALIBRATE
    settings = conductor_settings(spec, {}, args, 0, Path(args.tmp))
    config = SimConfig(
        n_prefill=0,
        n_decode=args.workers,
        mixed=True,
        truth=truth_from_emulator(load_profile(), args.time_scale),
        slo=Slo(ttft_s=settings["slo"]["ttft_s"], tbt_s=settings["slo"]["tbt_s"]),  # the gateway-wide SLO (the urgent class's)
        noise=args.noise,
        seed=noise_seed,
        pull="none",  # mixed workers pull nothing from each other
        classes=sim_classes(settings),
    )
    requests = workload(rates, args.urgent_fraction, args.duration, shapes(args.time_scale), seed)
    policy = build_policy(PolicySpec(settings["policy"], settings["policy_options"]), config)
    if not share:
        _without_share(policy)
    return simulate(policy, prompt_trace(requests), config)


def _without_share(policy: Policy) -> None:
    """The policy told its classes as usual but keeping no tenant service (no `tenant_share` rule)."""
    if not isinstance(policy, KvCacheAwarePolicy):
        raise SystemExit(f"the share rule is kvcache_aware's, not {type(policy).__name__}'s")
    configure = policy.configure_classes

    def without(rules: ClassRules) -> None:
        configure(rules)
        policy.tenants = None

    # the simulator tells the policy its classes when the run starts (traces/sim/engine.py): the one hook
    policy.configure_classes = without  # type: ignore[method-assign]


def calibrate(args: argparse.Namespace) -> float:
    """The highest `--sweep` rate whose mix Conductor without admission serves within SLO (bench_tenants.calibrate)."""
    best = 0.0
    for i, rate in enumerate(float(x) for x in args.sweep.split(",")):
        result = simulate_scenario({"A": rate / 2, "B": rate / 2}, 1000 + i, 0, CALIBRATE.admission, args)
        met = result.groups["all"]["met_sent"]
        print(f"  calibrate {rate:g} req/s: {met:.1%} within SLO", file=sys.stderr, flush=True)
        if met < args.capacity_met:
            break
        best = rate
    if best == 0.0:
        raise SystemExit(f"even the lowest --sweep rate misses {args.capacity_met:.0%}: lower it")
    return best


def run_repeat(capacity: float, args: argparse.Namespace, rep: int) -> dict[str, dict[str, Any]]:
    """Every scenario once: scenario -> group -> its figures (bench_tenants.run_router's shape)."""
    out: dict[str, dict[str, Any]] = {}
    for name, multiples in SCENARIOS.items():
        rates = {t: m * capacity for t, m in multiples.items()}
        result = simulate_scenario(rates, scenario_seed(name, rep), rep, CONDUCTOR.admission, args)
        out[name] = {g: dict(v) for g, v in result.groups.items()}
        u, b = result.groups[f"class:{URGENT}"], result.groups[f"class:{CLASSES[1]}"]
        missed = {k: int(v) for k, v in u.items() if k.startswith("missed:")}
        share = int(result.groups["all"].get(f"missed:{TENANT_SHARE}", 0))
        print(
            f"  seed {rep} {name:<6} urgent adm {u['admitted_share']:.0%} met/adm {u['met_admitted']:.1%} "
            f"| batch adm {b['admitted_share']:.0%} | A met {result.groups['tenant:A']['met_sent']:.1%} "
            f"B met {result.groups['tenant:B']['met_sent']:.1%} | urgent missed {missed} | {TENANT_SHARE} {share}",
            file=sys.stderr,
            flush=True,
        )
    return out


def run_trickle(capacity: float, args: argparse.Namespace, rep: int) -> dict[str, float]:
    """`TRICKLE` with and without the share rule: the fleet's met share of all sent, A's, the refusals."""
    rates = {t: m * capacity for t, m in TRICKLE.items()}
    seed = 100 * rep + len(SCENARIOS)  # after bench_tenants.py's scenarios' seeds
    on = simulate_scenario(rates, seed, rep, CONDUCTOR.admission, args)
    off = simulate_scenario(rates, seed, rep, CONDUCTOR.admission, args, share=False)
    out = {
        "met_all": on.groups["all"]["met_sent"],
        "met_all_no_share": off.groups["all"]["met_sent"],
        "A_met": on.groups["tenant:A"]["met_sent"],
        "A_met_no_share": off.groups["tenant:A"]["met_sent"],
        "refused": float(on.groups["all"].get(f"missed:{TENANT_SHARE}", 0)),
    }
    print(
        f"  seed {rep} trickle all met {out['met_all']:.1%} (no share rule {out['met_all_no_share']:.1%}) | A met "
        f"{out['A_met']:.1%} ({out['A_met_no_share']:.1%}) | {TENANT_SHARE} {int(out['refused'])}",
        file=sys.stderr,
        flush=True,
    )
    return out


GOAL_FIGURES = (
    ("urgent_met_admitted_3x", "3x urgent met among admitted", 100.0),
    ("urgent_admitted_3x", "3x urgent admitted", 100.0),
    ("batch_admitted_3x", "3x batch admitted", 100.0),
    ("batch_admitted_1x", "1x (share) batch admitted", 100.0),
    ("tenant_A_drop_points", "tenant A's loss to B's flood (points)", 1.0),
)


def compare(found: Mapping[str, Mapping[str, Any]], live: str) -> str:
    """Each goal figure, simulated and live, and the difference in points."""
    lines = [f"{'figure':<40} {'sim':>8} {'live':>8} {'sim-live':>9}"]
    for key, label, scale in GOAL_FIGURES:
        sim, real = found[SIM_COLUMN].get(key), found[live].get(key)
        if not isinstance(sim, float) or not isinstance(real, float):
            continue
        lines.append(f"{label:<40} {sim * scale:8.1f} {real * scale:8.1f} {(sim - real) * scale:+9.1f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="mixed workers")
    ap.add_argument("--time-scale", type=float, default=6.0, help="multiply the workers' modelled durations (and the SLOs)")
    ap.add_argument("--noise", type=float, default=0.05, help="timing noise (lognormal sigma)")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per scenario")
    ap.add_argument("--repeat", type=int, default=4, help="seeds")
    ap.add_argument("--urgent-fraction", type=float, default=0.3)
    ap.add_argument("--capacity", type=float, default=None, help="req/s of the mix (default: swept)")
    ap.add_argument("--sweep", default="3,4,5,6,7")
    ap.add_argument("--capacity-met", type=float, default=0.95)
    ap.add_argument("--max-inflight", type=int, default=None, help="as bench_tenants.py's")
    ap.add_argument("--sheddable-share", type=float, default=None, help="as bench_tenants.py's")
    ap.add_argument("--batch-admit", type=float, default=0.0, help="as bench_tenants.py's")
    ap.add_argument("--live", default=None, help="a bench_tenants.py --json file: its routers' columns beside the simulation")
    ap.add_argument("--no-trickle", dest="trickle", action="store_false", help="skip the simulated trickle scenario")
    ap.add_argument("--json", dest="json_out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.log_level = "warning"  # conductor_settings' (the gateway's log level: nothing in a simulation)
    with tempfile.TemporaryDirectory(prefix="bench-sim-tenants-") as tmp:
        args.tmp = tmp  # conductor_settings writes the scaled predictor params here
        capacity = args.capacity or calibrate(args)
        runs = [run_repeat(capacity, args, r) for r in range(args.repeat)]
        trickles = [run_trickle(capacity, args, r) for r in range(args.repeat)] if args.trickle else []
    cells: dict[str, list[dict[str, dict[str, Any]]]] = {SIM_COLUMN: runs}
    if args.live:
        live = json.loads(Path(args.live).read_text(encoding="utf-8"))
        cells.update({f"{name} (live)": runs for name, runs in live["runs"].items()})
    classes = shapes(args.time_scale)
    slos = ", ".join(f"{c} TTFT {classes[c].ttft_s:g}s TBT {classes[c].tbt_s:g}s" for c in CLASSES)
    print(f"capacity {capacity:g} req/s; {slos}; urgent share {args.urgent_fraction:g}; {args.repeat} seed(s) simulated")
    for scenario in SCENARIOS:
        print("\n" + table(scenario, {k: [r for r in v if scenario in r] for k, v in cells.items()}))
    found = goals(cells)
    sim = found[SIM_COLUMN]
    drops = [round(100 * (r["share"]["tenant:A"]["met_sent"] - r["flood"]["tenant:A"]["met_sent"]), 1) for r in cells[SIM_COLUMN]]
    print(
        f"\n{SIM_COLUMN}: 3x urgent met/admitted {sim['urgent_met_admitted_3x']:.1%}, admitted urgent "
        f"{sim['urgent_admitted_3x']:.0%} vs batch {sim['batch_admitted_3x']:.0%}; tenant A loses "
        f"{statistics.median(drops):.1f} points to B's flood (per seed {drops})"
    )
    if trickles:
        on, off = (statistics.median(t[k] for t in trickles) for k in ("met_all", "met_all_no_share"))
        a_on, a_off = (statistics.median(t[k] for t in trickles) for k in ("A_met", "A_met_no_share"))
        print(
            f"trickle (A {TRICKLE['A']:g}x, B {TRICKLE['B']:g}x of capacity): all met over sent {on:.1%} with the share "
            f"rule, {off:.1%} without ({100 * (on - off):+.1f} points); A met {a_on:.1%} / {a_off:.1%}; "
            f"{TENANT_SHARE} refusals per seed {[int(t['refused']) for t in trickles]}"
        )
    live_conductor = f"{CONDUCTOR.name} (live)"
    if live_conductor in found:
        print("\n" + compare(found, live_conductor))
    if args.json_out:
        settings = {k: v for k, v in vars(args).items() if k != "tmp"}
        out = {"settings": settings, "capacity_rps": capacity, "runs": cells, "goals": found, "trickle": trickles}
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
