"""Gateway overhead, side by side: Conductor (one process and `--workers 2`), vllm-router and
sglang-router in front of the same stand-in workers, with wrk as the load.

    python benchmarks/bench_gateway.py [--quick] [--seconds 4] [--repeat 2] [--against REV]
    python benchmarks/bench_gateway.py --fleet two-models [--repeat 3] [--concurrency 16,64]

Cells: mixed (two workers) and P/D (one prefill, one decode: NIXL for Conductor and vllm-router,
SGLang's bootstrap fields for sglang-router), non-stream (8 tokens) and 32-token streams, at
concurrency 1, 16 and 64; each router's CPU per request (from /proc, the process and its children)
and its added p50/p99 over the workers hit directly; then the throughput ceiling (non-stream, mixed,
concurrency 256) with round_robin and kvcache_aware. Every cell runs every router back to back, in
alternating order, `--repeat` times (the median is kept): this box is shared and noisy, so read the
ratios of one run, not the absolute figures. `--against REV` adds, after the cells, the regression
check the request-path issue asks for: this checkout's CPU per request over Conductor's as it was at a
git revision (its tree exported with `git archive`, run with the same Python), measured as
benchmarks/paired_cpu.py measures it: both gateways (one process each, round_robin) loaded at the same
time, `--against-repeat` pairs per mode and body. Run one after the other, the two would differ by the
10-25% the box's background load moves a run; loaded together, both see the same load.

`--fleet two-models` measures instead what serving several models costs: Conductor (`conductor serve
--mixed A --mixed B`, round_robin and then kvcache_aware, the default) in front of two stand-ins serving
two different models, wrk's requests alternating between the models, against the same in front of two
stand-ins serving one model (one pool) under the same wrk load; the two configurations alternate,
`--repeat` times, and each one's CPU per request (median and range) and their ratio are printed.

The peers live in their own virtual environments (found at these paths, or pass --vllm-router /
--sglang-router; a missing one is reported and skipped):

    python3 -m venv /tmp/vr-venv && /tmp/vr-venv/bin/pip install vllm-router
    python3 -m venv /tmp/sr-venv && /tmp/sr-venv/bin/pip install sglang-router

wrk comes from the distribution (`apt-get install wrk`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import ROOT, Processes, conductor_serve, cpu_seconds, export_revision, free_port, wait_http

from tests.support.servers import free_port_run

BODY = '{"model":"tiny","prompt":"benchmark prompt","max_tokens":%d,"stream":%s}'
# what every wrk run prints at its end: one line bench_gateway parses (requests, errors, p50, p99, duration)
WRK_DONE = """done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %d %d %d %d\\n", summary.requests,
    e.status + e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99),
    summary.duration))
end
"""
WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
"""


# --fleet: a `request` function alternating two bodies (both fleets run it: wrk's extra work is alike)
FLEET_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {'%s', '%s'}
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil, bodies[n %% 2 + 1])
end
"""
# each gateway's wrk concurrency in --against's pairs (paired_cpu.py's default)
PAIRED_CONCURRENCY = 32
# the fleets compared: the models their two stand-ins serve (the first is conductor_serve's --model)
FLEETS = {"one-pool": ("tiny", "tiny"), "two-models": ("tiny", "tiny-b")}


@dataclass(frozen=True)
class Load:
    """What one wrk run measured: requests, failures, latency percentiles (us), duration (us)."""

    requests: int
    errors: int
    p50_us: float
    p99_us: float
    duration_us: float
    cpu_s: float | None  # the router's CPU over the run (None: the workers hit directly)

    @property
    def rps(self) -> float:
        return self.requests / (self.duration_us / 1e6)

    @property
    def cpu_us_per_request(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / max(self.requests, 1) * 1e6


@dataclass
class Router:
    name: str
    url: str
    pids: Callable[[], list[int]]  # the processes whose CPU counts


def _pids(proc: subprocess.Popen[bytes]) -> Callable[[], list[int]]:
    return lambda: [proc.pid]


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and of every live descendant (a supervisor and its workers)."""
    total = cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(tree_cpu(int(c)) for c in children)
    return total


def wrk(url: str, script: Path, conc: int, seconds: float, pids: list[int] | None, threads: int = 1) -> Load:
    # wrk takes whole seconds; one thread leaves the other core to the router for the CPU cells,
    # the ceiling runs wrk's default two (one thread capped vllm-router near 8,000 req/s)
    cmd = ["wrk", "-t", str(threads), "-c", str(conc), "-d", f"{max(1, round(seconds))}s", "--timeout", "30s"]
    cmd += ["-s", str(script), url]
    before = sum(tree_cpu(p) for p in pids) if pids else None
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cpu = sum(tree_cpu(p) for p in pids) - before if pids and before is not None else None
    fields = next(line for line in out.splitlines() if line.startswith("RESULT")).split()[1:]
    n, errors, p50, p99, duration = (int(f) for f in fields)
    return Load(n, errors, p50, p99, duration, cpu)


def scripts(tmp: Path) -> dict[str, Path]:
    out = {}
    for mode, body in (("non-stream", BODY % (8, "false")), ("stream32", BODY % (32, "true"))):
        out[mode] = tmp / f"{mode}.lua"
        out[mode].write_text(WRK_SCRIPT % body + WRK_DONE)
    return out


def start_workers(procs: Processes) -> dict[str, str]:
    urls = {}
    for name, role in (("mixed-a", "mixed"), ("mixed-b", "mixed"), ("prefill", "prefill"), ("decode", "decode")):
        port = free_port()
        procs.start([sys.executable, str(ROOT / "benchmarks/standin_worker.py"), "--role", role, "--port", str(port)], quiet=True)
        urls[name] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        wait_http(url + "/health")
    return urls


def start_routers(
    procs: Processes,
    w: dict[str, str],
    pd: bool,
    policy: str,
    vllm_router: str | None,
    sglang_router: str | None,
    workers: tuple[int, ...],
) -> list[Router]:
    routers = []
    for n in workers:
        port, admin = free_port(), free_port_run(n)
        inst = ["--prefill", w["prefill"], "--decode", w["decode"]] if pd else ["--mixed", w["mixed-a"], "--mixed", w["mixed-b"]]
        extra = ["--workers", str(n), "--admin-port", str(admin)] if n > 1 else []
        p = procs.start(
            conductor_serve(port, policy, *inst, *extra),
            quiet=True,
        )
        wait_http(f"http://127.0.0.1:{admin if n > 1 else port}/ready")
        if n > 1:
            for i in range(n):
                wait_http(f"http://127.0.0.1:{admin + i}/ready")
        routers.append(Router(f"conductor-w{n}" if n > 1 else "conductor", f"http://127.0.0.1:{port}/v1/completions", _pids(p)))
    peer_policy = "round_robin"
    if vllm_router:
        port = free_port()
        inst = (
            ["--vllm-pd-disaggregation", "--prefill", w["prefill"], "--decode", w["decode"]]
            if pd
            else ["--worker-urls", w["mixed-a"], w["mixed-b"]]
        )
        p = procs.start(
            [
                vllm_router,
                "--port",
                str(port),
                "--prometheus-port",
                str(free_port()),
                "--policy",
                peer_policy,
                *inst,
            ],
            quiet=True,
        )
        wait_http(f"http://127.0.0.1:{port}/health")
        routers.append(Router("vllm-router", f"http://127.0.0.1:{port}/v1/completions", _pids(p)))
    if sglang_router:
        port = free_port()
        inst = (
            ["--pd-disaggregation", "--prefill", w["prefill"], "none", "--decode", w["decode"]]
            if pd
            else ["--worker-urls", w["mixed-a"], w["mixed-b"]]
        )
        p = procs.start(
            [
                sglang_router,
                "-m",
                "sglang_router.launch_router",
                "--port",
                str(port),
                "--prometheus-port",
                str(free_port()),
                "--policy",
                peer_policy,
                *inst,
            ],
            quiet=True,
        )
        wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        routers.append(Router("sglang-router", f"http://127.0.0.1:{port}/v1/completions", _pids(p)))
    return routers


def measure_cell(
    routers: list[Router], direct: list[str], script: Path, conc: int, seconds: float, repeat: int
) -> dict[str, Load]:
    """Each router and the direct baseline, `repeat` rounds in alternating order; the median run of each
    is kept: by CPU per request for a router (the figure the ratios compare), by p50 for the direct
    baseline. P/D's direct baseline is the two legs measured one after the other, added."""
    runs: dict[str, list[Load]] = {}
    for r in range(repeat):
        order = routers if r % 2 == 0 else routers[::-1]
        legs = [wrk(url, script, conc, max(1.0, seconds / 2), None) for url in direct]
        runs.setdefault("direct", []).append(
            Load(
                min(leg.requests for leg in legs),
                0,
                sum(leg.p50_us for leg in legs),
                sum(leg.p99_us for leg in legs),
                legs[0].duration_us,
                None,
            )
        )
        for router in order:
            wrk(router.url, script, conc, 1, None)  # warm its pools
            runs.setdefault(router.name, []).append(wrk(router.url, script, conc, seconds, router.pids()))
    return {
        name: sorted(loads, key=lambda x: x.p50_us if x.cpu_s is None else x.cpu_s / max(x.requests, 1))[len(loads) // 2]
        for name, loads in runs.items()
    }


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def report_cell(title: str, cell: dict[str, Load]) -> list[str]:
    base = cell["direct"]
    lines = []
    peers = [n for n in cell if n not in ("direct",) and not n.startswith("conductor")]
    for name, load in cell.items():
        added50 = (load.p50_us - base.p50_us) / 1e3 if name != "direct" else None
        added99 = (load.p99_us - base.p99_us) / 1e3 if name != "direct" else None
        lines.append(
            f"{title:<24} {name:<14} {load.rps:>8.0f} {fmt(load.cpu_us_per_request):>9} "
            f"{load.p50_us / 1e3:>8.2f} {load.p99_us / 1e3:>8.2f} {fmt(added50, '+.2f'):>9} "
            f"{fmt(added99, '+.2f'):>9} {load.errors:>5}"
        )
    best_cpu = min((cell[p].cpu_us_per_request or 1e18 for p in peers), default=None)
    best_p99 = min((cell[p].p99_us for p in peers), default=None)
    for name in (n for n in cell if n.startswith("conductor")):
        c = cell[name]
        if best_cpu and best_p99 and c.cpu_us_per_request:
            # p99 compared as measured, through the same workers: the direct baseline's own tail (the
            # stand-ins' pauses) is too noisy to subtract
            lines.append(
                f"{'':<24} {name} / best peer: CPU per request {c.cpu_us_per_request / best_cpu:.2f}x, "
                f"p99 {c.p99_us / best_p99:.2f}x"
            )
    return lines


def fleet_scripts(tmp: Path) -> dict[tuple[str, str], Path]:
    """(fleet, body) -> a wrk script whose requests alternate between the fleet's two models."""
    out = {}
    for fleet, models in FLEETS.items():
        for mode, max_tokens, stream in (("non-stream", 8, "false"), ("stream32", 32, "true")):
            bodies = [BODY.replace('"tiny"', f'"{m}"') % (max_tokens, stream) for m in models]
            out[fleet, mode] = tmp / f"{fleet}-{mode}.lua"
            out[fleet, mode].write_text(FLEET_SCRIPT % tuple(bodies) + WRK_DONE)
    return out


def start_fleets(procs: Processes, policy: str) -> dict[str, Router]:
    """Per fleet, two stand-ins serving its models and a Conductor in front of them, as a user starts
    it (`conductor serve --mixed A --mixed B` with the benchmarks' usual flags); checked to list the
    fleet's models."""
    routers = {}
    for fleet, models in FLEETS.items():
        urls = []
        for model in models:
            port = free_port()
            argv = [sys.executable, str(ROOT / "benchmarks/standin_worker.py"), "--port", str(port), "--model", model]
            procs.start(argv, quiet=True)
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_http(url + "/health")
        port = free_port()
        p = procs.start(conductor_serve(port, policy, "--mixed", urls[0], "--mixed", urls[1]), quiet=True)
        wait_http(f"http://127.0.0.1:{port}/ready")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as reply:
            listed = sorted(card["id"] for card in json.load(reply)["data"])
        if listed != sorted(set(models)):
            raise RuntimeError(f"{fleet}: the gateway lists {listed}, not {sorted(set(models))}")
        routers[fleet] = Router(fleet, f"http://127.0.0.1:{port}/v1/completions", _pids(p))
    return routers


def fleet_cell(
    routers: dict[str, Router], lua: dict[tuple[str, str], Path], mode: str, conc: int, seconds: float, repeat: int
) -> dict[str, list[Load]]:
    """Each fleet's runs of one cell, `repeat` rounds, the fleets' order alternating."""
    runs: dict[str, list[Load]] = {fleet: [] for fleet in routers}
    for r in range(repeat):
        for fleet in list(routers)[:: -1 if r % 2 else 1]:
            router = routers[fleet]
            wrk(router.url, lua[fleet, mode], conc, 1, None)  # warm its pools
            runs[fleet].append(wrk(router.url, lua[fleet, mode], conc, seconds, router.pids()))
    return runs


def spread(xs: list[float], spec: str) -> str:
    """The median of `xs` and their range."""
    return f"{format(statistics.median(xs), spec)} [{format(min(xs), spec)}-{format(max(xs), spec)}]"


def fleet_ratios(runs: dict[str, list[Load]]) -> list[float]:
    """two-models' CPU per request over one-pool's, round by round (the two runs of a round adjoin)."""
    cpu = {fleet: [load.cpu_us_per_request or 0.0 for load in loads] for fleet, loads in runs.items()}
    return [b / a for a, b in zip(cpu["one-pool"], cpu["two-models"], strict=True)]


def report_fleet_cell(title: str, runs: dict[str, list[Load]]) -> list[str]:
    """CPU per request of each fleet (median of rounds, [min-max]), and two-models over one-pool."""
    cpu = {fleet: [load.cpu_us_per_request or 0.0 for load in loads] for fleet, loads in runs.items()}
    lines = []
    for fleet, loads in runs.items():
        rps = statistics.median(load.rps for load in loads)
        p99 = statistics.median(load.p99_us for load in loads) / 1e3
        errors = sum(load.errors for load in loads)
        lines.append(f"{title:<28} {fleet:<11} {spread(cpu[fleet], '.0f'):>18} {rps:>8.0f} {p99:>8.2f} {errors:>6}")
    lines.append(f"{title:<28} two-models / one-pool, CPU per request: {spread(fleet_ratios(runs), '.2f')}x (per round)")
    return lines


def fleet_comparison(args: argparse.Namespace) -> list[str]:
    """--fleet two-models: every cell (policy, body, concurrency) of the two fleets, side by side."""
    head = f"{'cell':<28} {'fleet':<11} {'cpu us/req [range]':>18} {'req/s':>8} {'p99 ms':>8} {'errors':>6}"
    lines = [f"CPU per request: median of {args.repeat} runs of {args.seconds:g} s [min-max]", head]
    print("\n".join(lines), flush=True)
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        lua = fleet_scripts(Path(tmp))
        for policy in ("round_robin", "kvcache_aware"):
            with Processes() as procs:
                routers = start_fleets(procs, policy)
                for mode in ("non-stream", "stream32"):
                    for conc in (int(c) for c in args.concurrency.split(",")):
                        runs = fleet_cell(routers, lua, mode, conc, args.seconds, args.repeat)
                        ratios += fleet_ratios(runs)
                        shown = report_fleet_cell(f"{policy} {mode} c{conc}", runs)
                        lines += shown
                        print("\n".join(shown), flush=True)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    lines.append(
        f"every cell's rounds together ({len(ratios)}): two-models / one-pool, CPU per request "
        f"{statistics.median(ratios):.3f}x, quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}x, "
        f"geometric mean {statistics.geometric_mean(ratios):.3f}x"
    )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router") or "/tmp/vr-venv/bin/vllm-router")
    ap.add_argument(
        "--sglang-router", default="/tmp/sr-venv/bin/python", help="the Python of the virtualenv sglang-router is installed in"
    )
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each measured wrk run")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--modes", default="mixed,pd")
    ap.add_argument("--workers", default="1,2", help="Conductor process counts to measure")
    ap.add_argument("--quick", action="store_true", help="2 s runs, once, concurrency 1 and 64")
    ap.add_argument("--against", metavar="REV", help="also: this checkout's CPU per request over this git revision's, paired")
    ap.add_argument("--against-repeat", type=int, default=4, help="pairs per mode and body for --against (--quick: 1)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the throughput ceiling")
    ap.add_argument("--ceiling-only", action="store_true", help="only the throughput ceiling")
    ap.add_argument(
        "--fleet", choices=("two-models",), help="instead: two models behind Conductor against one pool (CPU per request)"
    )
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed: apt-get install wrk", file=sys.stderr)
        return 2
    if args.quick:
        args.seconds, args.repeat, args.concurrency, args.against_repeat = 2.0, 1, "1,64", 1
    if args.fleet:
        print("\n" + "\n".join(fleet_comparison(args)))
        return 0
    vllm_router = args.vllm_router if args.vllm_router and Path(args.vllm_router).exists() else None
    sglang_ok = (
        Path(args.sglang_router).exists()
        and subprocess.run([args.sglang_router, "-c", "import sglang_router"], capture_output=True).returncode == 0
    )
    sglang_router = args.sglang_router if sglang_ok else None
    for name, found in (("vllm-router", vllm_router), ("sglang-router", sglang_router)):
        if not found:
            print(f"{name} not found: its columns are left out (see the install line in --help)", file=sys.stderr)
    workers = tuple(int(n) for n in args.workers.split(","))
    lines = [
        f"{'cell':<24} {'router':<14} {'req/s':>8} {'cpu us':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'+p50 ms':>9} {'+p99 ms':>9} {'errs':>5}"
    ]
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        lua = scripts(Path(tmp))
        against = None
        if args.against:
            tree = Path(tmp) / "against"
            tree.mkdir()
            against = (args.against[:10], export_revision(args.against, tree))
        w = start_workers(procs)
        for mode in [] if args.ceiling_only else args.modes.split(","):
            pd = mode == "pd"
            with Processes() as rprocs:
                routers = start_routers(rprocs, w, pd, "round_robin", vllm_router, sglang_router, workers)
                direct = (
                    [w["prefill"] + "/v1/completions", w["decode"] + "/v1/completions"]
                    if pd
                    else [w["mixed-a"] + "/v1/completions"]
                )
                for stream in ("non-stream", "stream32"):
                    for conc in (int(c) for c in args.concurrency.split(",")):
                        title = f"{mode} {stream} c{conc}"
                        cell = measure_cell(routers, direct, lua[stream], conc, args.seconds, args.repeat)
                        shown = report_cell(title, cell)
                        lines += shown
                        print("\n".join(shown), flush=True)
        if against is not None and not args.ceiling_only:
            lines += paired_regression(w, lua, against, args)
        if not args.no_ceiling:
            lines += ceiling(w, lua["non-stream"], args, vllm_router, sglang_router, workers)
    print("\n" + "\n".join(lines))
    return 0


def paired_regression(w: dict[str, str], lua: dict[str, Path], against: tuple[str, Path], args: argparse.Namespace) -> list[str]:
    """--against: B/A CPU per request, B this checkout and A the revision, each pair of gateways
    started, warmed and loaded together by benchmarks/paired_cpu.py's `one_pair`."""
    from paired_cpu import one_pair  # here, not at the top: paired_cpu imports this module

    rev, tree = against
    pair = argparse.Namespace(policy="round_robin", concurrency=PAIRED_CONCURRENCY, seconds=args.seconds)
    lines = [
        "",
        f"regression check, paired (benchmarks/paired_cpu.py): CPU per request of this checkout over {rev}'s, both "
        f"loaded at once, round_robin, concurrency {PAIRED_CONCURRENCY} each, {args.seconds:g} s runs, median [min-max]:",
    ]
    print("\n".join(lines), flush=True)
    for mode in args.modes.split(","):
        for body in ("non-stream", "stream32"):
            ratios = []
            for _ in range(args.against_repeat):
                a, b = one_pair(w, (tree, ROOT), ([], []), mode == "pd", lua[body], pair)
                ratios.append(b / a)
            line = f"  {mode:<6} {body:<11} conductor / conductor@{rev}: {spread(ratios, '.3f')}x ({len(ratios)} pairs)"
            print(line, flush=True)
            lines.append(line)
    return lines


def ceiling(
    w: dict[str, str],
    script: Path,
    args: argparse.Namespace,
    vllm_router: str | None,
    sglang_router: str | None,
    workers: tuple[int, ...],
) -> list[str]:
    """Requests per second at concurrency 256 (non-stream, mixed), each router alone on the box (the
    others not started), loaded as a plain `wrk -c 256` run loads it (two threads)."""
    lines = ["", "throughput ceiling, mixed non-stream, concurrency 256, wrk -t 2 (req/s, median of runs):"]
    results: dict[str, float] = {}
    alone: list[tuple[str, str | None, str | None, tuple[int, ...]]] = [
        (policy, None, None, (n,)) for policy in ("round_robin", "kvcache_aware") for n in workers
    ]
    alone += [("round_robin", vllm_router, None, ()), ("round_robin", None, sglang_router, ())]
    for policy, vllm, sglang, counts in alone:
        if not (counts or vllm or sglang):
            continue
        with Processes() as procs:
            for router in start_routers(procs, w, False, policy, vllm, sglang, counts):
                name = router.name if not router.name.startswith("conductor") else f"{router.name} {policy}"
                wrk(router.url, script, 256, 1, None, threads=2)
                runs = sorted(wrk(router.url, script, 256, args.seconds, None, threads=2).rps for _ in range(args.repeat))
                results[name] = statistics.median(runs)
    ref = results.get("vllm-router")
    for name, rps in results.items():
        ratio = f"  {rps / ref:.2f}x vllm-router" if ref else ""
        lines.append(f"  {name:<32} {rps:>8.0f}{ratio}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
