"""Instructions per request of the gateway, counted by valgrind (callgrind): the same on a busy box.

    python benchmarks/instructions.py --a 35c8dd7 --b .          # B/A per cell, mixed and P/D
    python benchmarks/instructions.py --b . --modes mixed --bodies non-stream --requests 300

CPU seconds per request move 10-25% with whatever else the box runs, more than the few percent a
change to the request path is worth; benchmarks/paired_cpu.py cancels most of that by loading two
gateways at once, but still needs several pairs to see 3%. Callgrind counts the instructions the
gateway process executes instead: the count is repeatable (the same binary and inputs give the same
total whatever the other core does), so one run of a few hundred requests settles a difference of
1%. Instructions are not time (cache misses, branch mispredictions and system calls are not in the
count), so a result found here is confirmed with paired_cpu.py before it is claimed.

Each gateway (`conductor serve` with every default and `--a-args`/`--b-args`, from its exported
tree) runs under `valgrind --tool=callgrind --instr-atstart=no` (interpreted about 50x slower) in front
of the stand-in workers. After a warm-up, instrumentation is switched on, `--requests` requests are
sent by `--concurrency` keep-alive clients (another process, not counted), and the count dumped; then
the same wall time with no requests is counted (timers, the log writer, the health loop), and that
idle count is taken off. What remains over the number of requests is the instructions per request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_gateway import BODY, start_workers
from common import Processes, conductor_serve, free_port, wait_http
from paired_cpu import tree_of


async def send(url: str, n: int, concurrency: int, body: str) -> None:
    """`n` requests over `concurrency` keep-alive connections; any answer but a 200 stops the run."""
    queue = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:

        async def one_client() -> None:
            for _ in queue:
                r = await client.post(url, content=body, headers={"content-type": "application/json"})
                await r.aread()
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")

        await asyncio.gather(*(one_client() for _ in range(concurrency)))


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def dumped_instructions(out_dir: Path, before: set[Path]) -> int:
    """The instruction total of the dump written since `before` was listed."""
    fresh = [p for p in out_dir.iterdir() if p not in before]
    if len(fresh) != 1:
        raise RuntimeError(f"expected one new callgrind dump, found {fresh}")
    match = re.search(r"^(?:summary|totals): (\d+)", fresh[0].read_text(errors="replace"), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no totals in {fresh[0]}")
    return int(match.group(1))


def count(pid: int, out_dir: Path, action: object) -> tuple[int, float]:
    """Instructions the gateway executed while `action()` ran, and the wall seconds it took."""
    control(pid, "--zero")
    before = set(out_dir.iterdir())
    started = time.monotonic()
    action()  # type: ignore[operator]
    elapsed = time.monotonic() - started
    control(pid, "--dump")
    for _ in range(600):  # the dump is written when the process next polls for commands
        if len(set(out_dir.iterdir()) - before) == 1:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # let the file be complete
    return dumped_instructions(out_dir, before), elapsed


def per_request(tree: Path, extra: list[str], inst: list[str], body: str, args: argparse.Namespace) -> float:
    """One gateway under callgrind: instructions per request, idle time's count taken off."""
    with Processes() as procs, tempfile.TemporaryDirectory() as out:
        port = free_port()
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p"]
        gw = procs.start(valgrind + conductor_serve(port, args.policy, *inst, *extra), quiet=True, pythonpath=tree)
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=600)
        url = f"http://127.0.0.1:{port}/v1/completions"
        asyncio.run(send(url, args.warmup, args.concurrency, body))
        control(gw.pid, "--instr=on")
        busy, elapsed = count(gw.pid, Path(out), lambda: asyncio.run(send(url, args.requests, args.concurrency, body)))
        idle, _ = count(gw.pid, Path(out), lambda: time.sleep(elapsed))
        return (busy - idle) / args.requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default=None, help="revision of gateway A ('.': this checkout); none: B alone")
    ap.add_argument("--b", default=".", help="revision of gateway B ('.': this checkout)")
    ap.add_argument("--a-args", default="")
    ap.add_argument("--b-args", default="")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--modes", default="mixed,pd")
    ap.add_argument("--bodies", default="non-stream,stream32")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    bodies = {"non-stream": BODY % (8, "false"), "stream32": BODY % (32, "true")}
    sides = [("B", args.b, args.b_args)] + ([("A", args.a, args.a_args)] if args.a is not None else [])
    lines = []
    with tempfile.TemporaryDirectory() as tmp, Processes() as workers:
        w = start_workers(workers)
        trees = {name: tree_of(rev, Path(tmp), name) for name, rev, _ in sides}
        for mode in args.modes.split(","):
            pd = ["--prefill", w["prefill"], "--decode", w["decode"]]
            inst = pd if mode == "pd" else ["--mixed", w["mixed-a"], "--mixed", w["mixed-b"]]
            for body in args.bodies.split(","):
                got = {name: per_request(trees[name], more.split(), inst, bodies[body], args) for name, _, more in sides}
                line = f"{mode:<6} {body:<11} " + "  ".join(f"{k} {v / 1e6:.3f} M instr/req" for k, v in got.items())
                if "A" in got:
                    line += f"  B/A {got['B'] / got['A']:.3f}"
                print(line, flush=True)
                lines.append(line)
    print(f"instructions per request (callgrind), policy {args.policy}, A = {args.a} {args.a_args}, B = {args.b} {args.b_args}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
