"""Conductor against vllm-router and sglang-router, live, on the same emulated workers (issue 13).

    python benchmarks/bench_live_vs_peers.py --quick            # < 2 minutes
    python benchmarks/bench_live_vs_peers.py                    # a few minutes
    python benchmarks/bench_live_vs_peers.py --rates 1,2,3 --repeat 3 --json out.json

For every router and every speed-up: a FRESH cluster of `--workers` emulated vLLM workers (mixed
role: prefix cache, vLLM KV events, the bundled Qwen3-8B/H800 timing profile times `--time-scale`),
the router in front of them, and the same slice of Mooncake's conversation trace replayed through
it with the same speed-up (`--rates`). Routers: Conductor kvcache_aware with admission
("predicted"), kvcache_aware without admission, Conductor round_robin, vllm-router round_robin and
cache_aware, sglang-router cache_aware. `--shape pd` makes half the workers prefill and half decode,
over NIXL, with vllm-router in its `--vllm-pd-disaggregation` mode; sglang-router is left out there:
its P/D mode speaks SGLang's bootstrap protocol, so it would not be on the same workers.

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
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchmarks.aiperf_load import DEFAULT_AIPERF, replay_aiperf
from conductor.demo.cluster import ChildGroup, free_ports
from traces.formats import TraceRequest, load_trace, resolve_trace
from traces.live import replay_live
from traces.live_results import LiveResult
from traces.sim.results import render_table
from traces.synth import PromptSynthesizer

MODEL = "Qwen/Qwen3-8B"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One column: which router, which policy."""

    name: str
    kind: str  # conductor | vllm | sglang
    policy: str
    admission: str = "predicted"  # Conductor kvcache_aware only
    options: tuple[tuple[str, Any], ...] = ()  # further policy options (Conductor)


ALGORITHM1 = (("ttft_slack", None), ("inflight_prefixes", False))  # the lowest TTFT, blind to prefixes in flight

ROUTERS = (
    RouterSpec("conductor kv+adm", "conductor", "kvcache_aware", "predicted"),
    RouterSpec("conductor alg1+adm", "conductor", "kvcache_aware", "predicted", ALGORITHM1),
    RouterSpec("conductor kv", "conductor", "kvcache_aware", "none"),
    RouterSpec("conductor rr", "conductor", "round_robin"),
    RouterSpec("vllm-router rr", "vllm", "round_robin"),
    RouterSpec("vllm-router cache", "vllm", "cache_aware"),
    RouterSpec("sglang-router cache", "sglang", "cache_aware"),
)


@dataclass(frozen=True, slots=True)
class Measured:
    """One replay through one router: the client's summary and the workers' prefix-cache counters."""

    result: LiveResult
    worker_hits: float
    worker_queries: float

    @property
    def hit_rate(self) -> float:
        return self.worker_hits / self.worker_queries if self.worker_queries > 0 else 0.0


def _scaled_params(time_scale: float, log_dir: Path) -> str:
    """kvcache_aware's predictor params, fitted from the bundled profile and scaled like the workers."""
    from predictors.profile import bundled_profile, fit_profiles

    path = log_dir / "predictor-params.json"
    fit_profiles([bundled_profile()]).scaled(time_scale, time_scale, time_scale).save(path)
    return str(path)


def start_workers(group: ChildGroup, n: int, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """`n` emulators with KV events on, by role: all mixed, or (`--shape pd`) half prefill, half
    decode speaking NIXL; the same seeds on every cluster."""
    roles = ["mixed"] * n if args.shape == "mixed" else ["prefill"] * (n // 2) + ["decode"] * (n - n // 2)
    ports = iter(free_ports(3 * n))
    workers: dict[str, list[dict[str, Any]]] = {}
    for i, role in enumerate(roles):
        port, events, side = next(ports), next(ports), next(ports)
        url = f"http://127.0.0.1:{port}"
        group.start(
            f"{role}-{i}",
            [
                sys.executable,
                "-m",
                "adapters.emulator",
                "--role",
                role,
                "--pd-protocol",
                "nixl",
                "--port",
                str(port),
                "--model",
                MODEL,
                "--time-scale",
                repr(args.time_scale),
                "--noise",
                repr(args.noise),
                "--seed",
                str(i),
                "--engine-id",
                f"bench-{role}-{i}",
                "--side-channel-port",
                str(side),
                "--log-level",
                "warning",
                "--kv-events-endpoint",
                f"tcp://*:{events}",
            ],
            url,
        )
        workers.setdefault(role, []).append({"url": url, "name": f"{role}-{i}", "kv_events_endpoint": f"tcp://*:{events}"})
    return workers


def _urls(workers: dict[str, list[dict[str, Any]]], role: str) -> list[str]:
    return [w["url"] for w in workers.get(role, [])]


def start_router(
    group: ChildGroup, spec: RouterSpec, workers: dict[str, list[dict[str, Any]]], args: argparse.Namespace, log_dir: Path
) -> tuple[str, str]:
    """Start the router; (its base URL, the path that answers 200 once it is ready)."""
    port, prom = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    urls = _urls(workers, "mixed")
    if spec.kind == "vllm":
        # vllm-router's P/D mode drives NIXL as vLLM's toy proxy does: prefill with
        # kv_transfer_params {do_remote_decode}, then decode with what the prefill returned
        where = (
            ["--worker-urls", *urls]
            if urls
            else [
                "--vllm-pd-disaggregation",
                *(x for u in _urls(workers, "prefill") for x in ("--prefill", u)),
                *(x for u in _urls(workers, "decode") for x in ("--decode", u)),
            ]
        )
        group.start(
            "router",
            [
                args.vllm_router,
                "--port",
                str(port),
                "--prometheus-port",
                str(prom),
                "--policy",
                spec.policy,
                "--log-level",
                "warning",
                *where,
            ],
        )
        return url, "/health"
    if spec.kind == "sglang":
        group.start(
            "router",
            [
                args.sglang_router,
                "-m",
                "sglang_router.launch_router",
                "--port",
                str(port),
                "--prometheus-port",
                str(prom),
                "--policy",
                spec.policy,
                "--log-level",
                "warn",
                "--worker-urls",
                *urls,
            ],
        )
        return url, "/health"
    options: dict[str, Any] = {}
    if spec.policy == "kvcache_aware":
        options["admission"] = spec.admission
        options.update(spec.options)
        if args.time_scale != 1.0:  # predictions true to the scaled workers
            options["predictor_params"] = _scaled_params(args.time_scale, log_dir)
    settings = {
        "host": "127.0.0.1",
        "port": port,
        "logs": {"level": "warning"},
        "policy": spec.policy,
        "policy_options": options,
        "models": [MODEL],
        **workers,
        "pd": {"protocol": "nixl"},
        "health": {"interval_s": 1.0},
        "block_size": 16,
        "slo": {"ttft_s": args.slo_ttft, "tbt_s": args.slo_tbt},
        "kv": {"enabled": True, "tokenizer": "builtin"},
    }
    config = log_dir / "gateway.yaml"
    config.write_text(json.dumps(settings), encoding="utf-8")  # JSON is YAML
    group.start("router", [sys.executable, "-m", "conductor", "serve", "--config", str(config)])
    return url, "/ready"


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def wait_up(group: ChildGroup, checks: Sequence[str], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    for check in checks:
        while not _ok(check):
            dead = group.dead()
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].proc.returncode}:\n{dead[0].log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{check} not ready after {timeout_s:.0f}s")
            time.sleep(0.2)


_SAMPLE = r"^{}_total\{{[^}}]*\}}\s+([0-9.eE+-]+)"


def worker_prefix_counters(urls: Sequence[str]) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the workers' vLLM-style /metrics."""
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as resp:
            text = resp.read().decode()
        for name, add in (("vllm:prefix_cache_hits", True), ("vllm:prefix_cache_queries", False)):
            value = sum(float(m) for m in re.findall(_SAMPLE.format(re.escape(name)), text, re.M))
            if add:
                hits += value
            else:
                queries += value
    return hits, queries


def gateway_kv_figures(url: str) -> str:
    """What Conductor's KV index says of itself: hash agreement, predicted vs reported cached tokens."""
    from traces.live_client import sample_value

    with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as resp:
        text = resp.read().decode()
    names = (
        "conductor_kv_hash_agreement",
        "conductor_kv_predicted_cached_tokens_total",
        "conductor_kv_reported_cached_tokens_total",
    )
    return " ".join(f"{n.removeprefix('conductor_kv_')}={sample_value(text, n)}" for n in names)


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
        workers = start_workers(group, args.workers, args)
        url, ready = start_router(group, spec, workers, args, log_dir)
        wait_up(group, [*(f"{w['url']}/health" for ws in workers.values() for w in ws), url + ready])
        if spec.kind == "conductor":  # /ready is up before KV events flow; give the subscribers a moment
            time.sleep(1.0)
        # the prefix cache that counts is where prompts are computed: mixed or prefill workers
        urls = _urls(workers, "mixed") or _urls(workers, "prefill")
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


def find_peers(args: argparse.Namespace) -> dict[str, str]:
    """Router name -> why it cannot run here (those that can are left out)."""
    missing: dict[str, str] = {}
    if not (args.vllm_router and Path(args.vllm_router).exists()):
        missing.update({s.name: "vllm-router not installed" for s in ROUTERS if s.kind == "vllm"})
    sglang_ok = (
        Path(args.sglang_router).exists()
        and subprocess.run([args.sglang_router, "-c", "import sglang_router"], capture_output=True).returncode == 0
    )
    if not sglang_ok or args.shape == "pd":
        why = "P/D needs SGLang-protocol workers" if sglang_ok else "sglang-router not installed"
        missing.update({s.name: why for s in ROUTERS if s.kind == "sglang"})
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conversation-head400")
    ap.add_argument("--requests", type=int, default=200, help="first N requests of the trace")
    ap.add_argument("--skip", type=int, default=0, help="start the slice after this many requests")
    ap.add_argument("--rates", default="3,4,5", help="comma-separated speed-ups of the trace's arrivals")
    ap.add_argument("--repeat", type=int, default=1, help="runs per router and rate (median and min..max shown)")
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
    ap.add_argument("--length-scale", type=float, default=0.125, help="scale prompt and output lengths")
    ap.add_argument("--slo-ttft", type=float, default=1.5, help="TTFT SLO, seconds (0.5 s times --time-scale)")
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
    args = ap.parse_args(argv)
    if args.load == "aiperf" and not Path(args.aiperf).exists():
        ap.error(f"--load aiperf: {args.aiperf} not found (see the module docstring to install it)")
    if args.quick:
        args.requests, args.repeat = 120, 1
        args.rates = "4" if args.rates == ap.get_default("rates") else args.rates.split(",")[0]
    wanted = {n.strip() for n in args.routers.split(",")}
    missing = {n: why for n, why in find_peers(args).items() if n in wanted}
    specs = [s for s in ROUTERS if s.name in wanted and s.name not in missing]
    loaded = load_trace(resolve_trace(args.trace), limit=args.skip + args.requests).requests[args.skip :]
    synth = PromptSynthesizer(args.length_scale, seed=0)
    requests = sorted(loaded, key=lambda r: r.arrival_s)
    tokens = sum(len(synth.synthesize(r).prompt) for r in requests)
    print(
        f"{len(requests)} requests of {args.trace} (after {args.skip}), {tokens} prompt tokens, "
        f"{args.workers} {args.shape} workers (time scale {args.time_scale:g}), SLO TTFT {args.slo_ttft:g}s "
        f"TBT {args.slo_tbt:g}s, load by {args.load}",
        file=sys.stderr,
    )
    out: dict[str, Any] = {"settings": vars(args), "rates": {}}
    tables = []
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for rate in (float(x) for x in args.rates.split(",")):
            cells: dict[str, list[Measured]] = {}
            for rep in range(args.repeat):
                for spec in specs if rep % 2 == 0 else specs[::-1]:
                    started = time.monotonic()
                    m = run_one(spec, requests, synth, rate, args, Path(tmp))
                    cells.setdefault(spec.name, []).append(m)
                    r = m.result.run
                    print(
                        f"  {rate:g}x {spec.name:<20} goodput {r.goodput_rps:.2f}/s met {r.slo_attainment:.0%} "
                        f"429 {r.rejected} hit {m.hit_rate:.0%} ({time.monotonic() - started:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
            table, ratio = report(rate, cells, missing)
            tables.append(table)
            out["rates"][f"{rate:g}"] = {
                "ratio_vs_best_peer": ratio,
                "runs": {
                    n: [{**m.result.run.as_dict(), "worker_prefix_hit_rate": m.hit_rate} for m in runs]
                    for n, runs in cells.items()
                },
            }
    print("\n\n".join(tables))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
