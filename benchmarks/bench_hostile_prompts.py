"""Hostile prompt sizes, side by side: /health latency and the gateway's memory while four huge prompts
arrive at once, for this checkout and (with --against REV) Conductor as it was at a git revision.

    python benchmarks/bench_hostile_prompts.py [--against 35c8dd7] [--repeat 3]

One emulated mixed worker; each gateway runs with KV awareness on and the built-in tokenizer (set by
environment variables both revisions read). Two loads per gateway: four prompts just under the body
limit (15.5 MB each: before issue 34 they were tokenized, keyed and looked up on the event loop and
forwarded) and four prompts at the largest size the prompt bound admits (120,000 bytes, under the
131,072-token default). A thread polls /health every 20 ms throughout. Printed per gateway and load:
the answers' statuses, /health p50 and max (medians over --repeat runs, with their spread) and the
growth of the gateway's peak RSS (VmHWM). Absolute times drift on this shared box: read the rows
side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Processes, conductor_serve, export_revision, free_port, wait_http

HUGE = 15_500_000
LARGEST_ADMITTED = 120_000
ENV = {"CONDUCTOR_KV__ENABLED": "true", "CONDUCTOR_KV__TOKENIZER": "builtin"}


@dataclass(frozen=True)
class Run:
    statuses: tuple[int, ...]
    health_p50_ms: float
    health_max_ms: float
    rss_growth_mb: float


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _post(url: str, size: int) -> int:
    body = {"model": "tiny", "prompt": "x" * size, "max_tokens": 2}
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=300).status_code
    except httpx.HTTPError:
        return 0


def load(url: str, pid: int, size: int) -> Run:
    """Four prompts of `size` bytes at once while /health is polled."""
    done = threading.Event()
    latencies: list[float] = []

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                t0 = time.perf_counter()
                client.get(url + "/health")
                latencies.append((time.perf_counter() - t0) * 1000)
                done.wait(0.02)

    rss0 = peak_rss_mb(pid)
    poller = threading.Thread(target=poll)
    poller.start()
    with ThreadPoolExecutor(4) as pool:
        statuses = tuple(sorted(pool.map(lambda _: _post(url, size), range(4))))
    done.set()
    poller.join()
    return Run(statuses, statistics.median(latencies), max(latencies), peak_rss_mb(pid) - rss0)


def gateway(procs: Processes, worker: str, pythonpath: Path | None) -> tuple[str, int]:
    port = free_port()
    procs.env.update(ENV)
    p = procs.start(conductor_serve(port, "kvcache_aware", "--mixed", worker), quiet=True, pythonpath=pythonpath)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/ready", timeout=60)
    return url, p.pid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="also run Conductor as it was at this git revision")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with Processes() as procs, tempfile.TemporaryDirectory() as tmp:
        wport = free_port()
        procs.python("-m", "conductor", "emulate", "--role", "mixed", "--port", str(wport), "--model", "tiny", quiet=True)
        worker = f"http://127.0.0.1:{wport}"
        wait_http(worker + "/health")
        targets = {"this checkout": gateway(procs, worker, None)}
        if args.against:
            targets[f"conductor@{args.against}"] = gateway(procs, worker, export_revision(args.against, Path(tmp)))
        head = f"{'gateway':<22} {'prompt bytes':>12} {'statuses':<22} {'health p50 ms':>14}"
        print(f"{head} {'health max ms':>22} {'peak RSS +MB':>13}")
        for size in (HUGE, LARGEST_ADMITTED):
            for name, (url, pid) in targets.items():
                runs = [load(url, pid, size) for _ in range(args.repeat)]
                maxes = sorted(r.health_max_ms for r in runs)
                spread = f"{statistics.median(maxes):.0f} ({maxes[0]:.0f}-{maxes[-1]:.0f})"
                print(
                    f"{name:<22} {size:>12,} {','.join(map(str, runs[0].statuses)):<22} "
                    f"{statistics.median(r.health_p50_ms for r in runs):>14.1f} {spread:>22} "
                    f"{sum(r.rss_growth_mb for r in runs):>13.0f}"
                )


if __name__ == "__main__":
    main()
