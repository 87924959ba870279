"""Gateway overhead, side by side: CPU per request and added latency of Conductor against the same
stand-in workers hit directly, and against vllm-router, for nixl P/D.

    python benchmarks/bench_gateway.py [--vllm-router PATH] [--requests 2000]

vllm-router is optional: install it in its own virtualenv (`python -m venv /tmp/vr-venv &&
/tmp/vr-venv/bin/pip install vllm-router`) and pass its binary, or it is looked up on PATH and at
/tmp/vr-venv/bin/vllm-router. The load generator, the workers and the router under test share this
box, so absolute numbers drift; compare the ratios printed in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_seconds, free_port, wait_http


@dataclass
class Result:
    target: str
    mode: str
    concurrency: int
    requests: int
    cpu_us: float | None
    p50_ms: float
    p99_ms: float


async def _one(session: aiohttp.ClientSession, url: str, body: dict, stream: bool, direct: tuple[str, str] | None) -> float:
    t0 = time.perf_counter()
    if direct is not None:  # the client does both legs itself, as a gateway would
        prefill, decode = direct
        pbody = {**body, "stream": False, "max_tokens": 1,
                 "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                        "remote_block_ids": None, "remote_host": None, "remote_port": None}}
        async with session.post(prefill + "/v1/completions", json=pbody) as r:
            params = (await r.json())["kv_transfer_params"]
        body = {**body, "kv_transfer_params": params}
        url = decode + "/v1/completions"
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - t0


async def run_load(url: str, stream: bool, concurrency: int, n: int, direct: tuple[str, str] | None) -> list[float]:
    body = {"model": "tiny", "prompt": "benchmark prompt", "max_tokens": 32 if stream else 8, "stream": stream}
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(min(50, n)):  # warm the pools
            await _one(session, url, body, stream, direct)
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                latencies.append(await _one(session, url, body, stream, direct))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def measure(target: str, url: str, pid: int | None, stream: bool, conc: int, n: int,
            direct: tuple[str, str] | None = None) -> Result:
    before = cpu_seconds(pid) if pid else 0.0
    lat = asyncio.run(run_load(url, stream, conc, n, direct))
    cpu = (cpu_seconds(pid) - before) / (n + min(50, n)) * 1e6 if pid else None
    lat.sort()
    return Result(target, "stream32" if stream else "non-stream", conc, n, cpu,
                  statistics.median(lat) * 1e3, lat[int(len(lat) * 0.99) - 1] * 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router") or "/tmp/vr-venv/bin/vllm-router")
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()

    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        ports = {"prefill": free_port(), "decode": free_port()}
        for role, port in ports.items():
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "benchmarks/standin_worker.py"), "--role", role,
                                           "--port", str(port)], env=env))
        p_url, d_url = (f"http://127.0.0.1:{ports[r]}" for r in ("prefill", "decode"))
        for url in (p_url, d_url):
            wait_http(url + "/health")

        targets: list[tuple[str, str, int | None]] = []
        gw_port = free_port()
        gw = subprocess.Popen([sys.executable, "-m", "conductor", "serve", "--port", str(gw_port), "--prefill", p_url,
                               "--decode", d_url, "--pd-protocol", "nixl", "--log-level", "warning"], env=env)
        procs.append(gw)
        wait_http(f"http://127.0.0.1:{gw_port}/ready")
        targets.append(("conductor", f"http://127.0.0.1:{gw_port}/v1/completions", gw.pid))
        if args.vllm_router and Path(args.vllm_router).exists():
            vr_port = free_port()
            vr = subprocess.Popen([args.vllm_router, "--port", str(vr_port), "--vllm-pd-disaggregation",
                                   "--prefill", p_url, "--decode", d_url, "--log-level", "warning",
                                   "--policy", "round_robin"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(vr)
            wait_http(f"http://127.0.0.1:{vr_port}/health")
            targets.append(("vllm-router", f"http://127.0.0.1:{vr_port}/v1/completions", vr.pid))
        else:
            print(f"vllm-router not found at {args.vllm_router}: comparing with direct only", file=sys.stderr)

        results: list[Result] = []
        for stream in (False, True):
            for conc in (1, 64):
                n = args.requests if conc > 1 else max(200, args.requests // 5)
                results.append(measure("direct", "", None, stream, conc, n, direct=(p_url, d_url)))
                for name, url, pid in targets:
                    results.append(measure(name, url, pid, stream, conc, n))
        print_table(results)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    return 0


def print_table(results: list[Result]) -> None:
    print(f"\n{'target':<12} {'mode':<11} {'conc':>4} {'reqs':>6} {'cpu us/req':>11} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'added p50 ms':>13}")
    direct = {(r.mode, r.concurrency): r for r in results if r.target == "direct"}
    for r in results:
        d = direct[(r.mode, r.concurrency)]
        cpu = f"{r.cpu_us:.0f}" if r.cpu_us is not None else "-"
        added = f"{r.p50_ms - d.p50_ms:+.2f}" if r.target != "direct" else "-"
        print(f"{r.target:<12} {r.mode:<11} {r.concurrency:>4} {r.requests:>6} {cpu:>11} {r.p50_ms:>8.2f} "
              f"{r.p99_ms:>8.2f} {added:>13}")
    by = {(r.target, r.mode, r.concurrency): r for r in results}
    print()
    for (target, mode, conc), r in by.items():
        other = by.get(("vllm-router", mode, conc))
        if target == "conductor" and other and other.cpu_us and r.cpu_us:
            print(f"CPU ratio conductor / vllm-router, {mode}, concurrency {conc}: {r.cpu_us / other.cpu_us:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
