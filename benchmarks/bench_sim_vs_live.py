"""Simulated vs live goodput (issue 6): the same trace slice, the same policies and the same timing
model, once through the trace simulator and once through a real gateway in front of emulated vLLM
workers. Prints both goodputs and their ratio for each policy (target: within 10%), and with
several policies the ratio of each to the first, simulated and live side by side.

    python benchmarks/bench_sim_vs_live.py [--trace conversation] [--policies kvcache_aware,round_robin] \
        [--limit 300] [--speedup 4] [--length-scale 0.25] [--slo-ttft 0.5] [--slo-tbt 0.025] [--noise 0.05]

Policies are specs as `conductor replay --compare` takes them (`kvcache_aware:ttft_slack=null`);
kvcache_aware runs with predicted admission unless the spec says otherwise. A spec with
`local_prefill_tokens` (policies/local_prefill.py) may prefill short prompts on a decode instance
on both sides: live as one plain leg to the emulated decode, which computes it in its batch's
steps; both counts are printed. By default neither side pulls prefixes (`pull: none`,
`pd_peer_pull: off`; a decode's readback needs non-streamed answers and the replay streams). With
`--peer-pull` both do prefill-to-prefill pulls staged with priority on the holder: live over the
emulators' NIXL (conductor/routing/peer_pull.py), simulated with `--pull staged`.

Configuration: `--prefill` + `--decode` emulators (2 + 2 by default; nixl P/D, `--time-scale` 1 by default, lognormal noise)
behind `conductor serve --policy POLICY` with KV-cache awareness (the demo cluster of
conductor.demo.cluster); the first `--limit` requests of the bundled trace, lengths
scaled by `--length-scale` (traces.synth: shared hash ids -> shared token prefixes) and arrivals
`--speedup` times faster. The simulator replays the same scaled requests (same block structure) on
the same cluster with `traces.sim.truth.truth_from_emulator`: the emulators' own profile, so both sides time
prefill, KV transfer and decode steps by the same formulas and coefficients.

What differs, by construction: the live run pays HTTP and event-loop time (gateway, workers,
client on one 2-core box), the emulators' prefix cache uses 16-token blocks where the simulator
matches whole trace blocks, and the live decode instances step token by token where the
simulator's decode is a fluid model.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import httpx

from adapters.emulator.profile import load_profile
from conductor.core.types import Slo
from conductor.demo.cluster import ChildGroup, ClusterSpec, start_cluster, wait_ready
from policies.registry import load_policy
from traces.formats import TraceRequest, load_trace, resolve_trace
from traces.live import replay_live
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.results import RunResult
from traces.sim.runner import PolicySpec, parse_specs
from traces.sim.truth import truth_from_emulator
from traces.synth import PromptSynthesizer

MODEL = "tiny"


def scaled_requests(requests: list[TraceRequest], synth: PromptSynthesizer) -> list[TraceRequest]:
    """The requests as the live replay sends them: scaled lengths, same blocks, same arrivals."""
    return [
        dataclasses.replace(
            r, input_length=synth.input_length(r), output_length=synth.output_length(r), block_tokens=synth.block_tokens(r)
        )
        for r in requests
    ]


def policy_options(spec: PolicySpec, peer_pull: bool = False) -> dict[str, object]:
    """The spec's options; kvcache_aware with predicted admission and no pulls unless it says
    (peer pulls only with --peer-pull)."""
    options = dict(spec.options)
    if spec.name == "kvcache_aware":
        options.setdefault("admission", "predicted")
        options.setdefault("allow_pull", "peer" if peer_pull else False)
    return options


def run_sim(args: argparse.Namespace, requests: list[TraceRequest], spec: PolicySpec) -> RunResult:
    config = SimConfig(
        n_prefill=args.prefill,
        n_decode=args.decode,
        truth=truth_from_emulator(load_profile(), args.time_scale),
        slo=Slo(ttft_s=args.slo_ttft, tbt_s=args.slo_tbt),
        speedup=args.speedup,
        noise=args.noise,
        seed=args.seed,
        model=MODEL,
        pull="staged" if args.peer_pull else "none",
    )
    return simulate(load_policy(spec.name, policy_options(spec, args.peer_pull)), requests, config)


def run_live(args: argparse.Namespace, requests: list[TraceRequest], synth: PromptSynthesizer, spec: PolicySpec) -> RunResult:
    options = policy_options(spec, args.peer_pull)
    options.pop("allow_pull", None)  # the gateway derives what it can pull from its protocol
    # --peer-pull: every emulator bidirectional, prefills on priority scheduling, the gateway stages
    # prefill-to-prefill pulls (conductor/routing/peer_pull.py); without it, pulls off on both sides
    extra = (
        {"pd": {"peer_pull": "on", "peer_pull_priority": -1, "readback": "off"}, "kv": {"forward_token_ids": True}}
        if args.peer_pull
        else {"pd": {"peer_pull": "off"}}
    )
    cluster_spec = ClusterSpec(
        n_prefill=args.prefill,
        n_decode=args.decode,
        pd_protocol="nixl",
        policy=spec.name,
        model=MODEL,
        time_scale=args.time_scale,
        noise=args.noise,
        slo_ttft_s=args.slo_ttft,
        slo_tbt_s=args.slo_tbt,
        policy_options=options,
        gateway_extra=extra,
        # (the decodes are bidirectional so that they free the prefills' pins; their own pins, unused
        # with pd.readback off, expire at once)
        emulator_extra=("--bidirectional-kv-xfer", "--scheduling-policy", "priority", "--decoder-kv-blocks-ttl", "1")
        if args.peer_pull
        else (),
    )
    with tempfile.TemporaryDirectory(prefix="sim-vs-live-") as tmp:
        group = ChildGroup(Path(tmp))
        try:
            cluster = start_cluster(cluster_spec, group)
            wait_ready(cluster, group)
            result = asyncio.run(
                replay_live(
                    cluster.gateway_url,
                    requests,
                    time_scale=args.speedup,
                    slo_ttft_s=args.slo_ttft,
                    slo_tbt_s=args.slo_tbt,
                    synthesizer=synth,
                    model=MODEL,
                    label="live",
                )
            )
            if args.peer_pull:
                print("live prefill-to-prefill pulls: " + pull_counts(cluster.gateway_url), file=sys.stderr)
            if options.get("local_prefill_tokens"):
                extra = {**result.run.extra, "local_prefills": float(local_prefills(cluster.gateway_url))}
                return dataclasses.replace(result.run, extra=extra)
        finally:
            group.stop()
    return result.run


def pull_counts(gateway_url: str) -> str:
    """conductor_pd_peer_pull_total by event, and the staging requests' mean time, from /metrics."""
    counts: dict[str, float] = {}
    stage_sum = stage_n = 0.0
    for line in httpx.get(gateway_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("conductor_pd_peer_pull_total{"):
            counts[line.split('event="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("conductor_pd_peer_pull_stage_seconds_sum "):
            stage_sum = float(line.rsplit(" ", 1)[1])
        elif line.startswith("conductor_pd_peer_pull_stage_seconds_count "):
            stage_n = float(line.rsplit(" ", 1)[1])
    mean = f"{stage_sum / stage_n * 1e3:.1f} ms" if stage_n else "-"
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(counts.items())) + f"; staging mean {mean}"


def local_prefills(gateway_url: str) -> int:
    """Decisions that prefilled on a decode instance (conductor_decisions_total whose prefill is a
    decode: policies/local_prefill.py), from /metrics."""
    total = 0.0
    for line in httpx.get(gateway_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("conductor_decisions_total{") and 'prefill="decode-' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _row(name: str, r: RunResult) -> str:
    return (
        f"{name:>5}  {r.requests:>8}  {r.completed:>9}  {r.rejected:>8}  {r.slo_met:>7}  {r.goodput_rps:>9.3f}  "
        f"{r.ttft.p50:>8.3f}  {r.ttft.p99:>8.3f}  {r.tbt.mean * 1e3:>8.2f}  "
        f"{r.prefix_hit_local + r.prefix_hit_remote:>6.0%}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conversation", help="bundled trace name or path")
    ap.add_argument("--policies", default="kvcache_aware", help="comma-separated policy specs")
    ap.add_argument("--limit", type=int, default=300, help="first N requests of the trace")
    ap.add_argument("--speedup", type=float, default=4.0, help="arrivals this many times faster")
    ap.add_argument("--length-scale", type=float, default=0.25, help="prompt and output lengths x this")
    ap.add_argument("--slo-ttft", type=float, default=0.5)
    ap.add_argument("--slo-tbt", type=float, default=0.025)
    ap.add_argument("--noise", type=float, default=0.05, help="lognormal sigma, emulators and simulator")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the workers' durations x this, live and simulated; the policy's predictors still start "
        "from the bundled profile (x1), as a gateway in front of slower workers does: scale the "
        "SLOs with it",
    )
    ap.add_argument("--prefill", type=int, default=2, help="prefill instances (emulated, and simulated)")
    ap.add_argument("--decode", type=int, default=2, help="decode instances")
    ap.add_argument(
        "--peer-pull",
        action="store_true",
        help="prefix pulls between prefills, staged on the holder with priority: over NIXL live "
        "(pd_peer_pull), modelled in the simulator (--pull staged)",
    )
    args = ap.parse_args()
    try:
        specs = parse_specs(args.policies)
    except ValueError as exc:
        ap.error(str(exc))

    raw = list(load_trace(resolve_trace(args.trace), limit=args.limit).requests)
    synth = PromptSynthesizer(args.length_scale, seed=args.seed)
    requests = scaled_requests(raw, synth)
    span = (raw[-1].arrival_s - raw[0].arrival_s) / args.speedup
    print(
        f"{len(raw)} requests of {args.trace}, lengths x{args.length_scale:g}, {args.speedup:g}x faster "
        f"({span:.0f} s of arrivals); {args.prefill}P+{args.decode}D, SLO TTFT {args.slo_ttft} s / TBT {args.slo_tbt} s, "
        f"noise {args.noise}, workers' time scale {args.time_scale:g}",
        file=sys.stderr,
    )
    pairs = []
    for spec in specs:
        t0 = time.perf_counter()
        sim = run_sim(args, requests, spec)
        t_sim = time.perf_counter() - t0
        t0 = time.perf_counter()
        live = run_live(args, raw, synth, spec)
        t_live = time.perf_counter() - t0
        pairs.append((spec, sim, live))
        print(
            f"\n{spec.label or spec.name}\n{'':>5}  {'requests':>8}  {'completed':>9}  {'rejected':>8}  "
            f"{'SLO met':>7}  {'goodput/s':>9}  {'TTFT p50':>8}  {'TTFT p99':>8}  {'TBT ms':>8}  {'hit':>6}"
        )
        print(_row("sim", sim))
        print(_row("live", live))
        if args.peer_pull:  # the live count (staged) was printed as the run ended, on stderr
            print(
                f"simulated prefill-to-prefill pulls: {sim.extra.get('peer_pulls', 0):.0f} served requests "
                f"({sim.prefix_hit_remote:.1%} of their prompt tokens)"
            )
        ratio = sim.goodput_rps / live.goodput_rps if live.goodput_rps > 0 else float("inf")
        print(
            f"goodput sim / live = {ratio:.3f} (target 0.90-1.10); rejections sim {dict(sim.rejections)}, "
            f"live {dict(live.rejections)}; wall: sim {t_sim:.1f} s, live {t_live:.1f} s"
        )
        if "local_prefills" in live.extra:
            print(
                f"prefills on a decode instance (local prefill): sim {sim.extra['local_prefills']:.0f}, "
                f"live {live.extra['local_prefills']:.0f}"
            )
    if len(pairs) > 1:
        first_sim, first_live = pairs[0][1].goodput_rps, pairs[0][2].goodput_rps
        print(f"\ngoodput / {pairs[0][0].label or pairs[0][0].name}:")
        for spec, sim, live in pairs[1:]:
            s_ratio = first_sim / sim.goodput_rps if sim.goodput_rps else float("inf")
            l_ratio = first_live / live.goodput_rps if live.goodput_rps else float("inf")
            print(f"  against {spec.label or spec.name}: sim {s_ratio:.3f}, live {l_ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
