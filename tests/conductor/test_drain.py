"""SIGTERM drains: the gateway stops accepting, lets requests in flight finish within
`drain_grace_s`, and then closes what is left instead of waiting for ever."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.support.servers import free_port, serve
from tests.support.standin import StandIn
from tests.support.waiting import wait_for


@contextmanager
def gateway(worker_url: str, grace_s: float) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conductor",
            "serve",
            "--mixed",
            worker_url,
            "--port",
            str(port),
            "--model",
            "tiny",
            "--log-level",
            "warning",
        ],
        env={"CONDUCTOR_TIMEOUTS__DRAIN_GRACE_S": str(grace_s), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _ready(url), timeout=30), proc.stdout.read() if proc.poll() is not None else "not ready"
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _stream_in_background(url: str, out: list[str]) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                timeout=120,
                json={"model": "tiny", "prompt": "x", "max_tokens": 6, "stream": True},
            ) as r:
                out.append(r.read().decode())
        except httpx.HTTPError as exc:
            out.append(f"error: {exc!r}")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_requests_in_flight_finish_within_the_grace() -> None:
    worker = StandIn(role="mixed", model="tiny", token_delay_s=0.2)  # ~1.2 s stream
    with serve(worker) as w, gateway(w.url, grace_s=60) as (url, proc):
        out: list[str] = []
        thread = _stream_in_background(url, out)
        assert wait_for(lambda: len(worker.requests) == 1, timeout=10)
        proc.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
        assert out and out[0].rstrip().endswith("data: [DONE]")  # it was let finish
        assert len(worker.finished) == 1


def test_the_grace_bounds_the_drain() -> None:
    worker = StandIn(role="mixed", model="tiny", token_delay_s=100.0)  # would stream for ~10 minutes
    with serve(worker) as w, gateway(w.url, grace_s=1) as (url, proc):
        out: list[str] = []
        thread = _stream_in_background(url, out)
        assert wait_for(lambda: len(worker.requests) == 1, timeout=10)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)  # exits on its own, far sooner than the stream would end
        thread.join(timeout=60)
        assert out and "[DONE]" not in out[0]
        assert wait_for(lambda: len(worker.cancelled) == 1, timeout=10)  # the worker saw the leg close
