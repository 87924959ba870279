"""Where a gateway request's CPU goes, by stage: py-spy samples of a loaded gateway, attributed.

    python benchmarks/profile_gateway.py [--seconds 8] [--concurrency 64] [--modes mixed,pd] [--policy P] [--against REV]

For each mode (mixed: two stand-in workers; pd: one prefill and one decode, NIXL) and body (non-stream,
32-token stream), a gateway in its own process takes wrk's load while py-spy samples it (CPU time
only, idle excluded). Each sample is charged to the innermost frame that belongs to a stage below
(walking from the leaf outwards), so time in the standard library or C helpers goes to the stage
that called them. Printed: the share of samples per stage and that share of the gateway's measured
CPU per request (from /proc over the same run). Needs py-spy (`pip install py-spy`, in the test
extra's environment here) and wrk; ptrace must be allowed (root, or kernel.yama.ptrace_scope=0).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import scripts, start_workers, tree_cpu, wrk
from common import Processes, conductor_serve, export_revision, free_port, wait_http

# (stage, path fragments): the first stage whose fragment appears in a frame's file wins, frames
# taken from the leaf outwards; order matters only within one frame
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics (prometheus_client)", ("prometheus_client/", "conductor/ops/metrics.py", "conductor/ops/loop_metrics.py")),
    ("logging", ("/logging/", "conductor/ops/logs.py")),
    (
        "tokenize + block keys",
        (
            "adapters/tokenizers.py",
            "conductor/core/block_keys.py",
            "conductor/core/tokenization.py",
            "conductor/core/vllm_hash.py",
        ),
    ),
    ("index look-up", ("adapters/index/",)),
    ("prompt analysis (KV awareness)", ("conductor/kv/analyzer.py", "conductor/kv/analysis.py", "conductor/kv/agreement.py")),
    ("decision (policy, predictors)", ("policies/", "predictors/")),
    ("request parsing + validation", ("conductor/server/requests.py", "pydantic", "msgspec")),
    # the server side first: "adapters/http1" below would take its frames too
    (
        "HTTP server (adapters/http1_server, uvicorn, httptools)",
        (
            "adapters/http1_server.py",
            "adapters/http1_exchange.py",
            "uvicorn/",
            "httptools",
            "starlette/",
            "fastapi/",
            "conductor/server/app.py",
        ),
    ),
    ("upstream client (HTTP/1.1, P/D legs)", ("adapters/http1", "adapters/upstream.py", "adapters/pd/")),
    (
        "relay + response streaming",
        (
            "conductor/routing/relay.py",
            "conductor/routing/attempt.py",
            "conductor/routing/streams.py",
            "conductor/routing/batch_relay.py",
            "conductor/server/endpoint.py",
            "conductor/server/errors.py",
        ),
    ),
    (
        "gateway bookkeeping (load, deadlines)",
        (
            "conductor/gateway.py",
            "conductor/routing/router.py",
            "conductor/routing/pulls.py",
            "conductor/routing/request_path.py",
            "conductor/fleet/instances.py",
            "conductor/routing/deadlines.py",
            "adapters/load_share.py",
            "adapters/shm_load_share.py",
            "conductor/routing/readback.py",
            "conductor/ops/tracing.py",
        ),
    ),
    ("event loop (asyncio, uvloop)", ("asyncio/", "uvloop")),
)
FRAME = re.compile(r"\((?P<file>[^():]+)(?::\d+)?\)")


def stage_of(stack: str) -> tuple[str, str]:
    """(stage, the frame that decided it) of one sampled stack."""
    frames = stack.split(";")
    for frame in reversed(frames):  # leaf last in py-spy's collapsed format
        m = FRAME.search(frame)
        where = m.group("file") if m else frame
        for stage, fragments in STAGES:
            if any(f in where for f in fragments):
                return stage, frame.strip()
    return "other (interpreter, stdlib, C)", frames[-1].strip() if frames else ""


def breakdown(raw: Path) -> tuple[collections.Counter[str], collections.Counter[tuple[str, str]]]:
    """Samples per stage, and per (stage, deciding frame) for --detail."""
    counts: collections.Counter[str] = collections.Counter()
    frames: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            stage, frame = stage_of(stack)
            counts[stage] += int(n)
            frames[(stage, frame)] += int(n)
    return counts, frames


def profile_one(
    w: dict[str, str], pd: bool, policy: str, script: Path, conc: int, seconds: int, out: Path, tree: Path | None = None
) -> tuple[tuple[collections.Counter[str], collections.Counter[tuple[str, str]]], float, int]:
    """One gateway (this checkout, or the exported `tree` of another revision) under wrk, sampled."""
    with Processes() as procs:
        port = free_port()
        inst = ["--prefill", w["prefill"], "--decode", w["decode"]] if pd else ["--mixed", w["mixed-a"], "--mixed", w["mixed-b"]]
        gw = procs.start(conductor_serve(port, policy, *inst), quiet=True, pythonpath=tree)
        wait_http(f"http://127.0.0.1:{port}/ready")
        url = f"http://127.0.0.1:{port}/v1/completions"
        wrk(url, script, conc, 1, None)  # warm up
        spy = subprocess.Popen(
            [
                "py-spy",
                "record",
                "--pid",
                str(gw.pid),
                "--format",
                "raw",
                "--rate",
                "200",
                "--duration",
                str(seconds),
                "--nonblocking",
                "-o",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        before = tree_cpu(gw.pid)
        load = wrk(url, script, conc, seconds, None)
        cpu_us = (tree_cpu(gw.pid) - before) / max(load.requests, 1) * 1e6
        spy.wait(timeout=seconds + 30)
        return breakdown(out), cpu_us, load.requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--modes", default="mixed,pd")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--detail", type=int, default=0, help="also print the N frames that cost most, per stage")
    ap.add_argument("--against", default=None, help="also profile this git revision, alternating with the checkout")
    args = ap.parse_args()
    for tool in ("py-spy", "wrk"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (see --help)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp, Processes() as procs:
        lua = scripts(Path(tmp))
        w = start_workers(procs)
        trees: list[tuple[str, Path | None]] = [("this checkout", None)]
        if args.against:
            trees.append((args.against, export_revision(args.against, Path(tempfile.mkdtemp(dir=tmp)))))
        for mode in args.modes.split(","):
            for body in ("non-stream", "stream32"):
                for label, tree in trees:
                    raw = Path(tmp) / f"{mode}-{body}-{len(label)}.txt"
                    (counts, frames), cpu_us, n = profile_one(
                        w, mode == "pd", args.policy, lua[body], args.concurrency, args.seconds, raw, tree
                    )
                    print(f"\n{label}: {mode} {body}, concurrency {args.concurrency}, {args.policy}: {n} requests")
                    report(counts, frames, cpu_us, args.detail)
    return 0


def report(counts: collections.Counter[str], frames: collections.Counter[tuple[str, str]], cpu_us: float, detail: int) -> None:
    total = sum(counts.values()) or 1
    print(f"  {cpu_us:.0f} us CPU per request, {total} samples")
    for stage, k in counts.most_common():
        print(f"  {stage:<42} {100 * k / total:5.1f}%  {cpu_us * k / total:6.1f} us")
        top = [(f, c) for (st, f), c in frames.most_common() if st == stage][:detail]
        for frame, c in top:
            print(f"      {100 * c / total:5.1f}%  {frame[:110]} {cpu_us * c / total:6.1f} us")


if __name__ == "__main__":
    raise SystemExit(main())
