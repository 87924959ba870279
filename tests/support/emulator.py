"""Start emulated vLLM workers as real subprocesses on free loopback ports.

    with start_emulator(role="prefill", pd_protocol="mooncake", kv_events=True, time_scale=0.01) as emu:
        httpx.post(emu.url + "/v1/completions", json={...})

Every keyword argument that is not one of the helper's own becomes a command-line flag
(`block_size=32` -> `--block-size 32`). The helper picks the ports (HTTP, bootstrap for a prefill
instance, KV events PUB / replay when asked), waits for GET /health, and terminates the process at
exit, printing its log if it died early.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.ports import free_port
from tests.support.prom import metric_sum
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Emulator:
    """A running emulator: where to reach it and its process."""

    url: str  # http://127.0.0.1:PORT
    port: int
    bootstrap_port: int | None  # prefill's bootstrap server (mooncake / sglang)
    kv_events_endpoint: str | None  # where a subscriber connects: tcp://127.0.0.1:PORT
    kv_events_replay_endpoint: str | None
    engine_id: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def modelled(emu: Emulator, request_id: str) -> dict[str, Any]:
    """The times the emulator modelled for one request (GET /emulator/requests), by its X-Request-ID."""
    for record in httpx.get(emu.url + "/emulator/requests", timeout=30).json():
        if record["headers"].get("x-request-id") == request_id:
            (times,) = record["modelled"]
            return dict(times)
    raise AssertionError(f"no record of {request_id}")


def join_kv_feeds(gateway_url: str, emulators: Mapping[str, Emulator], within_s: float = 60.0) -> None:
    """Return once the gateway has received KV events from every emulator (by its instance name),
    the emulators emptied again.

    A ZMQ subscriber misses what is published before its subscription reached the publisher, so a
    test whose routing hangs on events first sends fresh prompts straight to each worker, bypassing
    the gateway, until the gateway counts a batch from it; then POST /emulator/reset forgets them
    (cache and request log: its AllBlocksCleared reaches the gateway ahead of any later event)."""
    with httpx.Client(timeout=30) as client:
        for name, emu in emulators.items():
            sent = 0

            def heard(instance: str = name, worker: Emulator = emu) -> bool:
                nonlocal sent
                if metric_sum(client.get(gateway_url + "/metrics").text, "conductor_kv_events_batches_total", instance=instance):
                    return True
                sent += 1
                prompt = f"feed check {sent} for {instance}. " * 3  # two full blocks of 16: a BlockStored batch
                client.post(worker.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}).raise_for_status()
                return False

            assert wait_for(heard, within_s, interval=0.05), f"the gateway heard no KV event from {name} ({sent} prompts)"
            client.post(emu.url + "/emulator/reset").raise_for_status()


def _flags(opts: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in opts.items():
        if value is None or value is False:
            continue
        out.append("--" + key.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


@contextmanager
def start_emulator(
    role: str = "mixed",
    pd_protocol: str = "nixl",
    *,
    kv_events: bool = False,
    kv_events_replay: bool = False,
    bootstrap: bool | None = None,
    engine_id: str | None = None,
    # a bound, not a speed check: under `-n 2` an emulator may start while the other worker's vLLM
    # engines start on both cores (a CI run saw one not healthy after 30 s, its log still empty)
    startup_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **opts: Any,
) -> Iterator[Emulator]:
    port = free_port()
    bootstrap_port = free_port() if (bootstrap if bootstrap is not None else role == "prefill") else None
    events = replay = None
    engine_id = engine_id or f"emu-{role}-{port}"
    args = [
        sys.executable,
        "-m",
        "adapters.emulator",
        "--role",
        role,
        "--pd-protocol",
        pd_protocol,
        "--port",
        str(port),
        "--engine-id",
        engine_id,
    ]
    if bootstrap_port is not None:
        args += ["--bootstrap-port", str(bootstrap_port)]
    if kv_events:
        events_port = free_port()
        args += ["--kv-events-endpoint", f"tcp://*:{events_port}"]
        events = f"tcp://127.0.0.1:{events_port}"
    if kv_events_replay:
        replay_port = free_port()
        args += ["--kv-events-replay-endpoint", f"tcp://*:{replay_port}"]
        replay = f"tcp://127.0.0.1:{replay_port}"
    if opts.get("bidirectional_kv_xfer") and "side_channel_port" not in opts:
        opts["side_channel_port"] = free_port()  # a bidirectional engine serves reads there
    args += _flags(opts)
    # closed in the finally below, after the process that writes it has exited
    log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix=f"emulator-{role}-{port}-", suffix=".log", delete=False
    )
    proc_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen(args, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=proc_env)
    emu = Emulator(f"http://127.0.0.1:{port}", port, bootstrap_port, events, replay, engine_id, proc, Path(log_file.name))
    try:
        _wait_healthy(emu, startup_timeout)
        yield emu
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()
        os.unlink(log_file.name)


def _wait_healthy(emu: Emulator, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    # one client for every poll: httpx.get() builds a client, and with it an SSL context that loads
    # the CA bundle, per call; every 50 ms on a CI box starved by vLLM start-ups, that was where a
    # module fixture spent its 120 s (three emulators, pytest-timeout inside load_verify_locations)
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if emu.proc.poll() is not None:
                raise RuntimeError(f"emulator exited with {emu.proc.returncode}:\n{emu.log()}")
            try:
                healthy = client.get(emu.url + "/health").status_code == 200
                if healthy and (emu.bootstrap_port is None or _port_open(emu.bootstrap_port)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"emulator on {emu.url} not healthy after {timeout}s:\n{emu.log()}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
