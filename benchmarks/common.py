"""Helpers the benchmarks share: ports, child processes, CPU accounting."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages and test support
    sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port as free_port  # noqa: E402  (one port chooser for tests and benchmarks)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its threads (children are not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status < 500:
                    return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def conductor_serve(port: int, policy: str, *args: str) -> list[str]:
    """`conductor serve` on `port` as a user starts it (every setting at its default: the INFO log with
    its decision lines, the models read from the workers), with `policy`, then `args`."""
    return [sys.executable, "-m", "conductor", "serve", "--port", str(port), "--policy", policy, *args]


def export_revision(rev: str, into: Path) -> Path:
    """This repository's tree at `rev`, written into `into` (to run as Processes.start(pythonpath=...))."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


class Processes:
    """Child processes started by a benchmark, all stopped on exit (by PID, never by name)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def python(self, *args: str, quiet: bool = False) -> subprocess.Popen[bytes]:
        return self.start([sys.executable, *args], quiet=quiet)

    def start(self, argv: list[str], quiet: bool = False, pythonpath: Path | None = None) -> subprocess.Popen[bytes]:
        """Start a child; `pythonpath` replaces this checkout on its import path (another revision)."""
        out = subprocess.DEVNULL if quiet else None
        env = self.env if pythonpath is None else {**self.env, "PYTHONPATH": str(pythonpath)}
        # run from that tree too: `python -m` puts the working directory first on the import path, so
        # from this checkout's root the other revision's PYTHONPATH would lose to this checkout
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, cwd=pythonpath)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def percentile(sorted_xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of an already sorted list, nearest rank; 0.0 when empty."""
    if not sorted_xs:
        return 0.0
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


class PrivateRedis:
    """A redis-server of the benchmark's own on a free port, so memory deltas and timings are not
    disturbed by whatever else uses the shared server; stopped (by PID) on exit."""

    def __init__(self, binary: str = "redis-server") -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrivateRedis:
        argv = [
            self._binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


# ---- workloads of bench_scale.py ------------------------------------------------------------


def event_payloads(
    n_instances: int, batches: int, *, block: int = 16, blocks_per_batch: int = 512, cache_blocks: int = 8192, seed: int = 0
) -> tuple[dict[str, list[bytes]], int]:
    """Per instance, `batches` encoded EventBatches; and the block events they carry in all."""
    # imported here: the other benchmarks import this module without the project's packages
    import msgspec
    import numpy as np

    from adapters.emulator.kv_events import block_removed, block_stored

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    encode = msgspec.msgpack.Encoder().encode
    out: dict[str, list[bytes]] = {}
    total = 0
    for i in range(n_instances):
        cache: deque[int] = deque()
        open_chains: list[int | None] = []  # the last block hash of requests still prefilling
        payloads = []
        for step in range(batches):
            events: list[dict[str, Any]] = []
            parts = rng.randint(1, 4)
            sizes = [blocks_per_batch // parts] * parts
            stored: list[tuple[list[int], int | None]] = []
            for size in sizes:
                parent = open_chains.pop() if open_chains and rng.random() < 0.6 else None
                hashes = [rng.getrandbits(64) for _ in range(size)]
                stored.append((hashes, parent))
                open_chains.append(hashes[-1])
            del open_chains[:-4]  # a few requests in flight at once
            new = sum(len(h) for h, _ in stored)
            excess = len(cache) + new - cache_blocks
            if excess > 0:  # removals first: they made the room, as one engine step reports them
                events.append(block_removed([cache.popleft() for _ in range(excess)]))
                total += excess
            for hashes, parent in stored:
                tokens = nrng.integers(0, 150_000, size=len(hashes) * block).tolist()
                events.append(block_stored(hashes, parent, tokens, block))
                cache.extend(hashes)
                total += len(hashes)
            payloads.append(encode([1.7e9 + step * 0.05, events, 0]))
        out[f"prefill-{i}"] = payloads
    return out, total


def redis_used_memory(url: str) -> int:
    """used_memory once lazy frees have settled (UNLINKs of an earlier run)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        for _ in range(200):
            info = client.info("memory")
            if int(info.get("lazyfree_pending_objects", 0)) == 0:
                return int(info["used_memory"])
            time.sleep(0.05)
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()
