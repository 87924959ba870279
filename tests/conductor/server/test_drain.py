"""SIGTERM drains: the gateway stops accepting, lets requests in flight finish within
`drain_grace_s`, and then ends what is left instead of waiting for ever: a stream with the same
SSE error event a worker failure sends, a request not yet answered with a 503, both retryable."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

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


@dataclass
class _Answer:
    """What a client in a background thread received, as it came."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    text: str = ""
    broken: str | None = None  # the connection failed before the answer was complete
    first_bytes: threading.Event = field(default_factory=threading.Event)  # also set when it failed


def _request_in_background(url: str, *, stream: bool) -> tuple[threading.Thread, _Answer]:
    answer = _Answer()

    def run() -> None:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 6, "stream": stream}
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json=body) as r:
                answer.status, answer.headers = r.status_code, dict(r.headers)
                for piece in r.iter_text():
                    answer.text += piece
                    answer.first_bytes.set()
        except httpx.HTTPError as exc:
            answer.broken = repr(exc)
        finally:
            answer.first_bytes.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, answer


def _events(text: str) -> list[str]:
    """The data of each SSE event in a streamed answer."""
    return [event.removeprefix("data: ") for event in text.strip().split("\n\n")]


def test_requests_in_flight_finish_within_the_grace() -> None:
    gate = threading.Semaphore(0)
    worker = StandIn(role="mixed", model="tiny", token_gate=gate)  # one token, then one per release
    with serve(worker) as w, gateway(w.url, grace_s=60) as (url, proc):
        thread, answer = _request_in_background(url, stream=True)
        assert answer.first_bytes.wait(timeout=30)  # the stream is under way
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: not _ready(url), timeout=30)  # the gateway stopped accepting: it drains
        for _ in range(5):
            gate.release()
        thread.join(timeout=60)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it drained on
        assert answer.broken is None and answer.text.rstrip().endswith("data: [DONE]")  # it was let finish
        assert not any('"error"' in event for event in _events(answer.text))  # untouched by the shutdown
        assert len(worker.finished) == 1


def test_a_stream_past_the_grace_ends_with_the_shutdown_error_event() -> None:
    # the worker sends one token and then nothing: the stream would outlast any grace
    worker = StandIn(role="mixed", model="tiny", token_gate=threading.Semaphore(0))
    with serve(worker) as w, gateway(w.url, grace_s=1) as (url, proc):
        thread, answer = _request_in_background(url, stream=True)
        assert answer.first_bytes.wait(timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # exits on its own once the grace is out
        thread.join(timeout=60)
        # the stream ended cleanly (no cut connection): the worker's token, the error, the end marker
        assert answer.broken is None, answer.broken
        events = _events(answer.text)
        assert len(events) == 3 and json.loads(events[0])["choices"][0]["text"] == "x ", answer.text
        error = json.loads(events[1])["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "gateway_shutdown")
        assert "shutting down" in error["message"]
        assert events[2] == "[DONE]"
        assert wait_for(lambda: len(worker.cancelled) == 1, timeout=10)  # the worker saw the leg close


def test_a_request_not_yet_answered_when_the_grace_ends_gets_a_503() -> None:
    worker = StandIn(role="mixed", model="tiny", hang=True)
    with serve(worker) as w, gateway(w.url, grace_s=1) as (url, proc):
        thread, answer = _request_in_background(url, stream=False)
        assert wait_for(lambda: len(worker.requests) == 1, timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        thread.join(timeout=60)
        assert answer.broken is None, answer.broken
        assert answer.status == 503, answer.text
        assert json.loads(answer.text)["error"]["code"] == "gateway_shutdown"
        assert answer.headers["x-should-retry"] == "true" and answer.headers["retry-after"] == "1"  # the SDKs retry it
        assert wait_for(lambda: len(worker.cancelled) == 1, timeout=10)
