"""Helpers the benchmarks share: ports, child processes, CPU accounting."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class Processes:
    """Child processes started by a benchmark, all stopped on exit (by PID, never by name)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def python(self, *args: str, quiet: bool = False) -> subprocess.Popen[bytes]:
        return self.start([sys.executable, *args], quiet=quiet)

    def start(self, argv: list[str], quiet: bool = False) -> subprocess.Popen[bytes]:
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=out)
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
