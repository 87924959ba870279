"""The chart's rendered command lines, run on this machine: the gateway on its rendered settings,
the Mooncake master, and a whole emulated cluster (workers.emulator.enabled) per P/D protocol that
answers a streamed completion through the gateway. Pods share ports in Kubernetes but share one
loopback here, so each pod's ports are remapped to free ones; everything else is the rendered text.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helm.chart import FULL, container, env, flag, needs_helm, one, render, venv_exe, wait_http
from tests.support.servers import free_port

pytestmark = needs_helm


@pytest.fixture
def rendered_gateway(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The gateway container's command, run here on the rendered settings (pods unreachable)."""
    docs = render("pdProtocol=mooncake", "prefill.replicas=2", "decode.replicas=1")
    c = container(one(docs, "Deployment", f"{FULL}-gateway"))
    config_file = tmp_path / "config.yaml"
    config_file.write_text(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])  # verbatim
    args = [str(config_file) if a == flag(c["args"], "--config") else a for a in c["args"]]
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    environ.update({k: v for k, v in env(c).items() if isinstance(v, str)})
    # what kubernetes would fill in, and this machine's Redis for the in-cluster one
    environ.update(CONDUCTOR_REPLICA_ID="rel-conductor-gateway-abc", CONDUCTOR_REDIS_URL="redis://127.0.0.1:6379/0",
                   CONDUCTOR_HOST="127.0.0.1", CONDUCTOR_PORT=str(port), CONDUCTOR_HEALTH_TIMEOUT_S="0.5")
    exe = venv_exe(c["command"][0])
    assert exe, c["command"]
    proc = subprocess.Popen([exe, *args], env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_rendered_gateway_command_starts_on_rendered_settings(
        rendered_gateway: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = rendered_gateway
    wait_http(url + "/health", proc)
    assert httpx.get(url + "/ready", timeout=5).status_code == 503  # the pods do not exist here: alive, not ready
    metrics = httpx.get(url + "/metrics", timeout=5).text
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")):
        assert f'conductor_instance_healthy{{instance="{name}",role="{role}"}}' in metrics


def test_rendered_mooncake_master_command_serves() -> None:
    """The master's rendered command line on the real binary: it accepts every flag and serves."""
    exe = venv_exe("mooncake_master")
    if exe is None:
        pytest.skip("no mooncake_master: pip install -e '.[mooncake]'")
    rpc, metrics, meta, events = (free_port() for _ in range(4))
    docs = render(f"mooncakeMaster.rpcPort={rpc}", f"mooncakeMaster.metricsPort={metrics}",
                  f"mooncakeMaster.httpMetadataServer.port={meta}", f"mooncakeMaster.kvEventsPort={events}")
    c = container(one(docs, "Deployment", f"{FULL}-mooncake-master"))
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    proc = subprocess.Popen([exe, *c["args"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        health = wait_http(f"http://127.0.0.1:{metrics}/health", proc)
        assert health.json()["service_ready"] is True
        # the built-in metadata server the transfer engines use answers on its own port
        assert httpx.get(f"http://127.0.0.1:{meta}/metadata", params={"key": "none"}, timeout=5).status_code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=10)
