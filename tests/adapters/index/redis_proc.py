"""A redis-server of the test's own, on a free port, that the test can hang (SIGSTOP), resume and kill.

The shared server on 6379 must never be stopped (other tests use it), so outage tests run their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.ports import free_port
from tests.support.redis_cluster import wait_ping


class RedisProcess:
    """One redis-server process; `start()` again after `kill()` brings it back on the same port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("the outage tests need the redis-server binary on PATH")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_ping(self.port, timeout_s, socket_timeout_s=0.2, poll_s=0.02)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def hang(self) -> None:
        """SIGSTOP: connections still open (the kernel accepts them) but nothing is ever answered."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process would not act on anything but SIGKILL
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def redis_process(*, started: bool = True) -> Iterator[RedisProcess]:
    server = RedisProcess()
    if started:
        server.start()
    try:
        yield server
    finally:
        server.kill()
