"""CPU per request of two gateways measured at the same time, so a shared box's load hits both alike.

    python benchmarks/paired_cpu.py --a 35c8dd7 --b HEAD [--modes mixed,pd] [--bodies non-stream,stream32]
    python benchmarks/paired_cpu.py --b-args "--workers 2 --admin-port 39411"      # one process vs two
    python benchmarks/paired_cpu.py --a HEAD --b HEAD                              # A/A: the noise itself

`bench_gateway.py --against` runs the two revisions one after the other: on a box where other jobs
come and go, a 10% difference drowns in the 10-25% a run's CPU per request moves with the background
load. Here both gateways (`conductor serve` with every default, `--a-args` / `--b-args` added, each
from its own exported tree, or this checkout for `.`) stand in front of the same stand-in workers and
are loaded by two wrk runs started together (concurrency `--concurrency` each, `--seconds` long); each
gateway's CPU per request comes from /proc (the process and its children) over its run, and B/A is
printed per repetition, then the median and range over `--repeat` (default 4). Run an A/A pair first:
its spread is the noise a B/A ratio must clear (about +-5% here, medians within 3%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_gateway import Load, scripts, start_workers, wrk
from common import ROOT, Processes, conductor_serve, export_revision, free_port, wait_http


def tree_of(rev: str, tmp: Path, name: str) -> Path:
    """`.`: this checkout as it is; anything else: that revision's tree, exported."""
    if rev == ".":
        return ROOT
    into = tmp / name
    into.mkdir()
    return export_revision(rev, into)


def one_pair(
    w: dict[str, str],
    trees: tuple[Path, Path],
    extra: tuple[list[str], list[str]],
    pd: bool,
    script: Path,
    args: argparse.Namespace,
) -> tuple[float, float]:
    """Both gateways started, warmed, then loaded together: (A's, B's) CPU us per request."""
    inst = ["--prefill", w["prefill"], "--decode", w["decode"]] if pd else ["--mixed", w["mixed-a"], "--mixed", w["mixed-b"]]
    with Processes() as procs:
        started = []
        for tree, more in zip(trees, extra, strict=True):
            port = free_port()
            gw = procs.start(conductor_serve(port, args.policy, *inst, *more), quiet=True, pythonpath=tree)
            wait_http(f"http://127.0.0.1:{port}/ready")
            started.append((gw, f"http://127.0.0.1:{port}/v1/completions"))
        for _, url in started:
            wrk(url, script, args.concurrency, 1, None)
        loads: dict[int, Load] = {}

        def load(i: int) -> None:
            gw, url = started[i]
            loads[i] = wrk(url, script, args.concurrency, args.seconds, [gw.pid])

        threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    a, b = (loads[i].cpu_us_per_request for i in range(2))
    assert a is not None and b is not None
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default=".", help="revision of gateway A ('.': this checkout)")
    ap.add_argument("--b", default=".", help="revision of gateway B ('.': this checkout)")
    ap.add_argument("--a-args", default="", help="extra `conductor serve` arguments for A")
    ap.add_argument("--b-args", default="", help="extra `conductor serve` arguments for B")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--modes", default="mixed,pd")
    ap.add_argument("--bodies", default="non-stream,stream32")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    lines = [f"B/A CPU per request, A = {args.a} {args.a_args}, B = {args.b} {args.b_args}, policy {args.policy}"]
    with tempfile.TemporaryDirectory() as tmp, Processes() as workers:
        trees = (tree_of(args.a, Path(tmp), "a"), tree_of(args.b, Path(tmp), "b"))
        extra = (args.a_args.split(), args.b_args.split())
        lua = scripts(Path(tmp))
        w = start_workers(workers)
        for mode in args.modes.split(","):
            for body in args.bodies.split(","):
                ratios = []
                for rep in range(args.repeat):
                    a, b = one_pair(w, trees, extra, mode == "pd", lua[body], args)
                    ratios.append(b / a)
                    print(f"{mode} {body} rep {rep}: A {a:.0f} us, B {b:.0f} us, B/A {b / a:.3f}", flush=True)
                lines.append(
                    f"  {mode:<6} {body:<11} B/A median {statistics.median(ratios):.3f}  "
                    f"range {min(ratios):.3f}-{max(ratios):.3f}  ({args.repeat} pairs)"
                )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
