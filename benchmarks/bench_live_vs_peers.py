"""Conductor against vllm-router and sglang-router, live, on the same emulated workers (issue 13).

    python benchmarks/bench_live_vs_peers.py --quick            # < 2 minutes
    python benchmarks/bench_live_vs_peers.py                    # a few minutes
    python benchmarks/bench_live_vs_peers.py --rates 1,2,3 --repeat 3 --json out.json

For every router and every speed-up: a FRESH cluster of `--workers` emulated vLLM workers (mixed
role: prefix cache, vLLM KV events, the bundled Qwen3-8B/H800 timing profile, or `--worker-profile`,
times `--time-scale`), the router in front of them, and the same slice of a trace (`--trace`:
Mooncake's conversation-head400 by default; conversation, synthetic, tool-agent or a file) replayed
through it with the same speed-up (`--rates`). Routers: Conductor kvcache_aware with admission
("predicted"), kvcache_aware without admission, Conductor round_robin, Conductor round_robin under
kvcache_aware's admission ("conductor rr+adm": `policy: judged`, `place: round_robin`,
policies/judged.py; what admission alone buys, apart from placement), vllm-router round_robin,
cache_aware, power_of_two and kv_aware (fed the workers' ZMQ KV events; it tokenizes text prompts
through the workers' /tokenize), sglang-router cache_aware. `--shape pd` makes half the workers
prefill and half decode, over NIXL, with vllm-router in its `--vllm-pd-disaggregation` mode;
sglang-router is left out there: its P/D mode speaks SGLang's bootstrap protocol, so it would not
be on the same workers.

`--capacity` measures capacity at SLO (benchmarks/capacity.py): the highest speed-up at which at
least 90% of the requests sent meet both SLOs, interpolated on the attainment curve of each router
(`--repeat`, default 3, full sweeps; router order alternates per sweep, rate order too), with its
min..max over the sweeps and its ratio to the best peer's; a markdown table, `--plot out.png`
(matplotlib, the `plot` extra), `--json` with every run and request. The workers run
`--worker-profile` (default there: conductor/data/profiles/qwen3-8b-a100-roofline.yaml) while
Conductor's predictors start from the bundled H800 fit scaled like the workers: not the workers'
timing, which they must learn online. `--from-json` redraws the table and plot of a saved run.

    python benchmarks/bench_live_vs_peers.py --capacity --rates 0.5,1,1.5,2 --plot cap.png --json cap.json

Peers measured with vllm-router 0.1.17 and sglang-router 0.3.2 (the header prints what is installed).

Prompts are sent as TEXT (each synthesized token id in 0..255 mapped to one printable ASCII
character, so the emulators' byte tokenizer sees a prompt of the same length and the trace's prefix
sharing is kept exactly): the peers' cache_aware policies match prompts as text, and a token-id
prompt would leave them nothing to match on. Measured at the client as traces/live.py does (the
same `summarize`): goodput = requests meeting both TTFT and TBT SLOs per second of replayed trace
time (a 429 or an error counts as not met); the prefix-cache hit rate is the workers' own
(`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` over the replay, summed over workers).

Runs alternate their router order per repeat; with `--repeat N` a cell shows the median and the
min..max of the goodput. The box is shared: read the ratios measured in one run, not the figures.

`--load aiperf` sends the same slice with NVIDIA's aiperf instead of the project's client (a load
generator none of the routers wrote; benchmarks/aiperf_load.py says how, and what it is given): the
same summary and table. It needs its own virtualenv too (`--aiperf` names its executable):

    python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf

The peers live in their own virtual environments (as in benchmarks/bench_gateway.py):

    python3 -m venv /tmp/vr-venv && /tmp/vr-venv/bin/pip install vllm-router
    python3 -m venv /tmp/sr-venv && /tmp/sr-venv/bin/pip install sglang-router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchmarks import capacity
from benchmarks.aiperf_load import DEFAULT_AIPERF, replay_aiperf
from benchmarks.live_routers import (
    MODEL,
    ROUTERS,
    RouterSpec,
    find_peers,
    gateway_kv_figures,
    idle_ceiling,
    profiles,
    role_urls,
    start_cluster,
    versions,
    vllm_kv_figures,
    worker_prefix_counters,
)
from conductor.demo.cluster import ChildGroup
from traces.formats import TraceRequest, load_trace, resolve_trace
from traces.live import replay_live
from traces.live_results import LiveResult
from traces.sim.results import render_table
from traces.synth import PromptSynthesizer

COLUMNS = tuple(s.name for s in ROUTERS)
PEERS = tuple(s.name for s in ROUTERS if s.kind != "conductor")

A100_PROFILE = "conductor/data/profiles/qwen3-8b-a100-roofline.yaml"


@dataclass(frozen=True, slots=True)
class Measured:
    """One replay through one router: the client's summary and the workers' prefix-cache counters."""

    result: LiveResult
    worker_hits: float
    worker_queries: float

    @property
    def hit_rate(self) -> float:
        return self.worker_hits / self.worker_queries if self.worker_queries > 0 else 0.0


def run_one(
    spec: RouterSpec,
    requests: Sequence[TraceRequest],
    synth: PromptSynthesizer,
    speedup: float,
    args: argparse.Namespace,
    log_root: Path,
) -> Measured:
    """A fresh cluster, the router, one replay; everything stopped afterwards."""
    log_dir = Path(tempfile.mkdtemp(prefix=spec.name.replace(" ", "-") + "-", dir=log_root))
    group = ChildGroup(log_dir)
    try:
        workers, url = start_cluster(group, spec, args, log_dir)
        # the prefix cache that counts is where prompts are computed: mixed or prefill workers
        urls = role_urls(workers, "mixed") or role_urls(workers, "prefill")
        before = worker_prefix_counters(urls)
        if args.load == "aiperf":  # aiperf synthesizes its own text from the hash ids (aiperf_load.py)
            result = replay_aiperf(
                url,
                requests,
                time_scale=speedup,
                synthesizer=synth,
                model=MODEL,
                slo_ttft_s=args.slo_ttft,
                slo_tbt_s=args.slo_tbt,
                work_dir=log_dir / "aiperf",
                aiperf=args.aiperf,
                label=spec.name,
                request_timeout_s=300.0,
            )
        else:  # text prompts: the peers' cache-aware policies match prompts as text (module docstring)
            result = asyncio.run(
                replay_live(
                    url,
                    requests,
                    time_scale=speedup,
                    concurrency_limit=args.concurrency,
                    slo_ttft_s=args.slo_ttft,
                    slo_tbt_s=args.slo_tbt,
                    synthesizer=synth,
                    model=MODEL,
                    label=spec.name,
                    request_timeout_s=300.0,
                    text_prompts=True,
                )
            )
        after = worker_prefix_counters(urls)
        if spec.kind == "conductor":
            print("   ", gateway_kv_figures(url), file=sys.stderr)
        elif spec.policy == "kv_aware":  # that its KV index matched the workers' blocks, not load alone
            print("   ", vllm_kv_figures(group), file=sys.stderr)
        dead = group.dead()
        if dead:
            raise RuntimeError(f"{dead[0].name} died during the replay:\n{dead[0].log_tail()}")
        return Measured(result, after[0] - before[0], after[1] - before[1])
    finally:
        group.stop()


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}ms"


def column(runs: Sequence[Measured]) -> list[tuple[str, str]]:
    """One router's rows: the median run (by goodput) and the spread of goodput over the runs."""
    ranked = sorted(runs, key=lambda m: m.result.run.goodput_rps)
    mid = ranked[len(ranked) // 2]
    r = mid.result.run
    goodputs = [m.result.run.goodput_rps for m in ranked]
    spread = f" [{goodputs[0]:.2f}..{goodputs[-1]:.2f}]" if len(runs) > 1 else ""
    return [
        ("goodput req/s", f"{statistics.median(goodputs):.2f}{spread}"),
        ("SLO met", f"{r.slo_attainment:.0%}"),
        ("TTFT p50 / p99", f"{_ms(r.ttft.p50)} / {_ms(r.ttft.p99)}"),
        ("TBT p50 / p99", f"{_ms(r.tbt.p50)} / {_ms(r.tbt.p99)}"),
        ("429s", str(r.rejected)),
        ("errors", str(int(r.extra.get("errors", 0)))),
        ("prefix hit (workers)", f"{mid.hit_rate:.0%}"),
    ]


def report(rate: float, cells: dict[str, list[Measured]], missing: dict[str, str]) -> tuple[str, float | None]:
    headers = ["", *(s.name for s in ROUTERS if s.name in cells or s.name in missing)]
    cols = [
        column(cells[s.name]) if s.name in cells else [("goodput req/s", f"n/a: {missing[s.name]}")]
        for s in ROUTERS
        if s.name in cells or s.name in missing
    ]
    lines = [f"speed-up {rate:g}x", render_table(headers, cols)]
    median = {n: statistics.median(m.result.run.goodput_rps for m in runs) for n, runs in cells.items()}
    peers = {n: g for n, g in median.items() if not n.startswith("conductor")}
    ratio = None
    if peers and "conductor kv+adm" in median:
        best = max(peers, key=lambda n: peers[n])
        met = statistics.median(m.result.run.slo_attainment for m in cells[best])
        ratio = median["conductor kv+adm"] / peers[best] if peers[best] > 0 else float("inf")
        lines.append(f"conductor kv+adm / best peer ({best}, SLO met {met:.0%}): goodput {ratio:.2f}x")
    return "\n".join(lines), ratio


def measure(
    spec: RouterSpec, requests: Sequence[TraceRequest], synth: PromptSynthesizer, rate: float, args: argparse.Namespace, tmp: str
) -> tuple[Measured, dict[str, Any]]:
    """One run, its progress line, and its JSON record (with every request's outcome under --capacity)."""
    started = time.monotonic()
    m = run_one(spec, requests, synth, rate, args, Path(tmp))
    r, wall, load = m.result.run, time.monotonic() - started, os.getloadavg()[0]
    ok = [o.http for o in m.result.outcomes if o.http.status == "ok"]
    late_ttft = sum(1 for h in ok if h.ttft_s is None or h.ttft_s > args.slo_ttft)
    late_tbt = sum(1 for h in ok if h.tbt_s is not None and h.tbt_s > args.slo_tbt)
    # why requests missed, and how late the client sent (a lagging client offers less than the rate)
    print(
        f"  {rate:g}x {spec.name:<20} goodput {r.goodput_rps:.2f}/s met {r.slo_attainment:.0%} (429 {r.rejected}, "
        f"err {int(r.extra.get('errors', 0))}, late TTFT {late_ttft} TBT {late_tbt}) hit {m.hit_rate:.0%} "
        f"client lag p99 {r.extra.get('client_lag_p99_s', 0.0):.2f}s ({wall:.0f}s, load {load:.1f})",
        file=sys.stderr,
        flush=True,
    )
    record = {
        **r.as_dict(),
        "late_ttft": late_ttft,
        "late_tbt": late_tbt,
        "worker_prefix_hit_rate": m.hit_rate,
        "wall_s": round(wall, 1),
        "loadavg_1m": load,
    }
    if args.capacity:
        record["outcomes"] = m.result.as_dict()["requests"]
    return m, record


def run_rates(
    specs: Sequence[RouterSpec],
    requests: Sequence[TraceRequest],
    synth: PromptSynthesizer,
    args: argparse.Namespace,
    missing: dict[str, str],
    out: dict[str, Any],
) -> None:
    """The tables per speed-up: every router at one rate, `--repeat` times, before the next rate."""
    tables = []
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for rate in capacity.parse_rates(args.rates):
            cells: dict[str, list[Measured]] = {}
            records: dict[str, list[dict[str, Any]]] = {}
            for rep in range(args.repeat):
                for spec in specs if rep % 2 == 0 else specs[::-1]:
                    m, record = measure(spec, requests, synth, rate, args, tmp)
                    cells.setdefault(spec.name, []).append(m)
                    records.setdefault(spec.name, []).append(record)
            table, ratio = report(rate, cells, missing)
            tables.append(table)
            out["rates"][f"{rate:g}"] = {"ratio_vs_best_peer": ratio, "runs": records}
    print("\n\n".join(tables))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conversation-head400", help="bundled trace name or file (traces/formats.py)")
    ap.add_argument("--requests", type=int, default=200, help="first N requests of the trace")
    ap.add_argument("--skip", type=int, default=0, help="start the slice after this many requests")
    ap.add_argument(
        "--rates",
        default=None,
        help="comma-separated speed-ups of the trace's arrivals (default 3,4,5; --capacity 0.5,0.75,1,1.5,2,3)",
    )
    ap.add_argument(
        "--repeat", type=int, default=None, help="runs per router and rate, median and min..max shown (default 1; --capacity 3)"
    )
    ap.add_argument("--workers", type=int, default=4, help="emulated workers per cluster")
    ap.add_argument(
        "--shape",
        choices=("mixed", "pd"),
        default="mixed",
        help="mixed workers, or half prefill / half decode over NIXL (sglang-router left out: "
        "its P/D mode needs SGLang-protocol workers)",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=3.0,
        help="multiply the workers' modelled durations (3: a slower GPU, so 2 cores carry 4 workers)",
    )
    ap.add_argument(
        "--worker-profile",
        default=None,
        help="the workers' timing profile, passed as the emulators' --profile ('bundled': the H800 one; "
        f"default: bundled, --capacity {A100_PROFILE})",
    )
    ap.add_argument("--length-scale", type=float, default=0.125, help="scale prompt and output lengths")
    ap.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        help="TTFT SLO, seconds (default 1.5: 0.5 s times --time-scale; 3 under --worker-profile, where an idle A100 "
        "roofline worker at time scale 3 prefills 7%% of conversation-head400's first 120 prompts in over 1.5 s)",
    )
    ap.add_argument("--slo-tbt", type=float, default=0.12, help="TBT SLO, seconds (40 ms times --time-scale)")
    ap.add_argument("--noise", type=float, default=0.05, help="workers' timing noise (lognormal sigma)")
    ap.add_argument("--concurrency", type=int, default=256, help="most requests in flight at the client (--load client only)")
    ap.add_argument("--routers", default=",".join(s.name for s in ROUTERS), help="comma-separated column names")
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router") or "/tmp/vr-venv/bin/vllm-router")
    ap.add_argument(
        "--sglang-router", default="/tmp/sr-venv/bin/python", help="the Python of the virtualenv sglang-router is installed in"
    )
    ap.add_argument(
        "--load",
        choices=("client", "aiperf"),
        default="client",
        help="load generator: the project's client (traces/live.py) or NVIDIA's aiperf",
    )
    ap.add_argument("--aiperf", default=DEFAULT_AIPERF, help="the aiperf executable (--load aiperf)")
    ap.add_argument("--json", dest="json_out", default=None, help="write every run's summary here")
    ap.add_argument("--quick", action="store_true", help="120 requests at one speed-up (4x unless --rates), once (< 2 minutes)")
    ap.add_argument("--capacity", action="store_true", help="capacity at SLO: sweep --rates, interpolate the 90%% crossing")
    ap.add_argument("--plot", default=None, help="--capacity: draw the attainment curves to this PNG (needs matplotlib)")
    ap.add_argument(
        "--from-json", default=None, help="--capacity: redraw the table (and --plot) of a saved --json run, run nothing"
    )
    args = ap.parse_args(argv)
    if args.load == "aiperf" and not Path(args.aiperf).exists():
        ap.error(f"--load aiperf: {args.aiperf} not found (see the module docstring to install it)")
    if (args.plot or args.from_json) and not args.capacity:
        ap.error("--plot and --from-json go with --capacity")
    args.rates = args.rates or ("0.5,0.75,1,1.5,2,3" if args.capacity else "3,4,5")
    args.repeat = args.repeat or (3 if args.capacity else 1)
    if args.worker_profile is None and args.capacity:
        args.worker_profile = str(Path(__file__).resolve().parent.parent / A100_PROFILE)
    if args.worker_profile == "bundled":
        args.worker_profile = None
    if args.slo_ttft is None:  # an SLO the workers' own timing can meet idle for nearly every prompt
        args.slo_ttft = 3.0 if args.worker_profile else 1.5
    if args.quick:
        args.requests, args.repeat = 120, 1
        args.rates = "4" if args.rates == "3,4,5" else args.rates.split(",")[0]
    capacity.parse_rates(args.rates)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        capacity.report(json.loads(Path(args.from_json).read_text(encoding="utf-8")), COLUMNS, PEERS, args.plot)
        return 0
    wanted = {n.strip() for n in args.routers.split(",")}
    missing = {n: why for n, why in find_peers(args).items() if n in wanted}
    specs = [s for s in ROUTERS if s.name in wanted and s.name not in missing]
    loaded = load_trace(resolve_trace(args.trace), limit=args.skip + args.requests).requests[args.skip :]
    synth = PromptSynthesizer(args.length_scale, seed=0)
    requests = sorted(loaded, key=lambda r: r.arrival_s)
    tokens = sum(len(synth.synthesize(r).prompt) for r in requests)
    span = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
    base_rps = len(requests) / span if span > 0 else 0.0
    header = [
        f"{len(requests)} requests of {args.trace} (after {args.skip}, {base_rps:.2f} req/s at 1x), {tokens} prompt "
        f"tokens, {args.workers} {args.shape} workers (time scale {args.time_scale:g}), SLO TTFT {args.slo_ttft:g}s "
        f"TBT {args.slo_tbt:g}s, load by {args.load}, {args.repeat} run(s) per rate",
        f"versions: {versions(args)}",
        f"profiles: {profiles(args)}",
        f"an idle worker prefills {idle_ceiling(requests, synth, args):.1%} of these prompts cold within the TTFT SLO",
    ]
    print("\n".join(header), file=sys.stderr, flush=True)
    out: dict[str, Any] = {"settings": vars(args), "header": header, "base_rps": base_rps, "missing": missing, "rates": {}}
    started = time.monotonic()
    if args.capacity:
        with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
            rates = capacity.parse_rates(args.rates)
            out["rates"] = capacity.sweep(specs, rates, args.repeat, lambda s, r: measure(s, requests, synth, r, args, tmp)[1])
    else:
        run_rates(specs, requests, synth, args, missing, out)
    out["wall_s"] = round(time.monotonic() - started, 1)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    if args.capacity:
        capacity.report(out, COLUMNS, PEERS, args.plot)
    print(f"wall time {out['wall_s']:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
