"""Logs an operator can ship: one JSON object a line with `log_format: json`, and an access-log line
per request (status, duration, instances, ids) that never carries the prompt."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx

from tests.support.servers import free_port, serve
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

SECRET = "the confidential prompt"


def test_json_logs_with_an_access_line_per_request() -> None:
    with serve(StandIn(role="mixed", model="tiny")) as worker:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "conductor", "serve", "--mixed", worker.url, "--port", str(port), "--model", "tiny"],
            env={"CONDUCTOR_LOGS__FORMAT": "json", "CONDUCTOR_LOGS__ACCESS_LOG": "true", "PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            assert wait_for(lambda: _up(url), timeout=30)
            r = httpx.post(
                url + "/v1/completions",
                json={"model": "tiny", "prompt": SECRET, "max_tokens": 2},
                headers={"X-Request-ID": "client-7"},
            )
            assert r.status_code == 200
            assert httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": SECRET}).status_code == 404
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
    lines = [line for line in out.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    access = [r for r in records if r["logger"] == "conductor.access"]
    assert [a["status"] for a in access] == [200, 404]
    ok = access[0]
    assert ok["path"] == "/v1/completions" and ok["prefill"] == "mixed-0" and ok["client_request_id"] == "client-7"
    assert ok["request_id"] != "client-7" and ok["duration_ms"] >= 0
    assert SECRET not in out


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
