"""The chart's rendered command lines, run on this machine: the gateway on its rendered settings,
the Mooncake master, and a whole emulated cluster (workers.emulator.enabled) per P/D protocol that
answers a streamed completion through the gateway. Pods share ports in Kubernetes but share one
loopback here, so each pod's ports are remapped to free ones; everything else is the rendered text.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from tests.helm.chart import FULL, STATIC, container, env, flag, needs_helm, one, render, venv_exe, wait_http
from tests.support.ci import require
from tests.support.servers import free_port

# the processes of a cluster start slowly on a loaded box (the gateway missed 30 s once, in a full
# run beside three vLLM engines): start-up bounds of 90 s, so the test bound is raised to match
pytestmark = [needs_helm, pytest.mark.timeout(400)]


@pytest.fixture
def rendered_gateway(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The gateway container's command, run here on the rendered settings (pods unreachable)."""
    docs = render(STATIC, "pdProtocol=mooncake", "prefill.replicas=2", "decode.replicas=1")
    c = container(one(docs, "Deployment", f"{FULL}-gateway"))
    config_file = tmp_path / "config.yaml"
    config_file.write_text(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])  # verbatim
    args = [str(config_file) if a == flag(c["args"], "--config") else a for a in c["args"]]
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    environ.update({k: v for k, v in env(c).items() if isinstance(v, str)})
    # what kubernetes would fill in, and this machine's Redis (own db: other tests share the load prefix)
    environ.update(
        CONDUCTOR_LOAD_SHARE__REPLICA_ID="rel-conductor-gateway-abc",
        CONDUCTOR_LOAD_SHARE__REDIS_URL="redis://127.0.0.1:6379/14",
        CONDUCTOR_KV__REDIS_URL="redis://127.0.0.1:6379/14",
        CONDUCTOR_HOST="127.0.0.1",
        CONDUCTOR_PORT=str(port),
        CONDUCTOR_HEALTH__TIMEOUT_S="0.5",
        # start-up waits this long for the absent prefill pods' Mooncake bootstrap servers
        CONDUCTOR_TIMEOUTS__BOOTSTRAP_S="0.5",
    )
    exe = venv_exe(c["command"][0])
    assert exe, c["command"]
    proc = subprocess.Popen([exe, *args], env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_rendered_gateway_command_starts_on_rendered_settings(rendered_gateway: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = rendered_gateway
    wait_http(url + "/health", proc)
    assert httpx.get(url + "/ready", timeout=5).status_code == 503  # the pods do not exist here: alive, not ready
    metrics = httpx.get(url + "/metrics", timeout=5).text
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")):
        assert f'conductor_instance_healthy{{instance="{name}",role="{role}"}}' in metrics
    # the Deployment's env switched on load sharing: this replica publishes its table to Redis
    assert redis.Redis(db=14).exists("conductor:load:rel-conductor-gateway-abc") == 1


def test_rendered_mooncake_master_command_serves() -> None:
    """The master's rendered command line on the real binary: it accepts every flag and serves."""
    exe = venv_exe("mooncake_master")
    require(exe is not None, "no mooncake_master: pip install -e '.[mooncake]'")
    assert exe is not None
    rpc, metrics, meta, events = (free_port() for _ in range(4))
    docs = render(
        f"mooncakeMaster.rpcPort={rpc}",
        f"mooncakeMaster.metricsPort={metrics}",
        f"mooncakeMaster.httpMetadataServer.port={meta}",
        f"mooncakeMaster.kvEventsPort={events}",
    )
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


def _remap(args: list[str], pod: str) -> tuple[list[str], dict[str, int]]:
    """A pod's rendered args for this loopback: the pod's own IP and name, and free ports in place of
    the ports every pod shares in the cluster. Returns the args and {flag: local port}."""
    out: list[str] = []
    local: dict[str, int] = {}
    for a in args:
        a = a.replace("$(POD_IP)", "127.0.0.1").replace("$(POD_NAME)", pod)
        if out and out[-1] in ("--port", "--bootstrap-port"):
            local[out[-1]] = free_port()
            a = str(local[out[-1]])
        elif out and out[-1] == "--kv-events-endpoint":
            local[out[-1]] = free_port()
            a = f"tcp://*:{local[out[-1]]}"  # still the rendered wildcard bind, on a free port
        out.append(a)
    return out, local


@pytest.mark.parametrize(("protocol", "n_prefill"), [("nixl", 1), ("mooncake", 2), ("sglang", 1)])
def test_emulated_cluster_from_the_chart_serves_a_stream(protocol: str, n_prefill: int, tmp_path: Path) -> None:
    docs = render(
        STATIC,
        "workers.emulator.enabled=true",
        f"pdProtocol={protocol}",
        f"prefill.replicas={n_prefill}",
        "decode.replicas=1",
        "gateway.replicas=1",
        "model.servedName=tiny",
        "gateway.apiKeys={sk-chart-run}",
    )
    # the client keys as the kubelet hands them over: the chart's Secret, named by the pods' env
    keys = base64.b64decode(one(docs, "Secret", f"{FULL}-gateway-api-keys")["data"]["api-keys"]).decode()
    cfg = yaml.safe_load(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])
    procs: list[subprocess.Popen[bytes]] = []
    index, prefix = redis.Redis(db=14), f"conductor:kv:test-{uuid.uuid4().hex}:"  # this test's own index
    try:
        for role in ("prefill", "decode"):
            c = container(one(docs, "StatefulSet", f"{FULL}-{role}"))
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
            exe = venv_exe(c["command"][0])
            assert exe, c["command"]
            for i, spec in enumerate(cfg[role]):
                args, local = _remap(c["args"], f"{FULL}-{role}-{i}")
                # the gateway entry for pod i, pointed at where pod i runs here
                spec["url"] = f"http://127.0.0.1:{local['--port']}"
                if "bootstrap_port" in spec:
                    spec["bootstrap_port"] = local["--bootstrap-port"]
                if "kv_events_endpoint" in spec:
                    spec["kv_events_endpoint"] = f"tcp://*:{local['--kv-events-endpoint']}"
                procs.append(subprocess.Popen([exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                wait_http(spec["url"] + "/health", procs[-1])
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(cfg))
        gw = container(one(docs, "Deployment", f"{FULL}-gateway"))
        port = free_port()
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
        environ.update(
            CONDUCTOR_HOST="127.0.0.1",
            CONDUCTOR_PORT=str(port),
            CONDUCTOR_HEALTH__INTERVAL_S="0.2",
            CONDUCTOR_AUTH__API_KEYS=keys,
            CONDUCTOR_KV__REDIS_URL="redis://127.0.0.1:6379/14",
            CONDUCTOR_KV__REDIS_PREFIX=prefix,
        )  # taken as written: a string field
        args = [str(config_file) if a == flag(gw["args"], "--config") else a for a in gw["args"]]
        gw_exe = venv_exe(gw["command"][0])
        assert gw_exe
        gw_log = tmp_path / "gateway.log"
        with gw_log.open("wb") as log_file:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    [gw_exe, *args], env={**environ, "CONDUCTOR_LOGS__LEVEL": "debug"}, stdout=subprocess.DEVNULL, stderr=log_file
                )
            )
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", procs[-1], timeout_s=180.0, log=gw_log)
        body = {"model": "tiny", "prompt": "the chart's cluster " * 30, "max_tokens": 8, "stream": True}
        auth = {"Authorization": "Bearer sk-chart-run"}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=30) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        # the request really went prefill -> decode: the decode engine took its prompt from remote KV
        decode_metrics = httpx.get(cfg["decode"][0]["url"] + "/metrics", timeout=5).text
        assert re.search(
            r'vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} [1-9]', decode_metrics
        ), decode_metrics
        # the prefill engine's KV events reached the gateway through the rendered endpoint: the shared
        # Redis index holds confirmed entries (dispatch guesses are stored as "u<expiry>")
        deadline = time.monotonic() + 10
        while not [v for v in index.hvals(f"{prefix}i:prefill-0") if v[:1].isdigit()]:
            assert time.monotonic() < deadline, "no KV event confirmed a block in the index"
            time.sleep(0.05)
        # `helm test`'s script, pointed at this gateway instead of the in-cluster Service
        smoke = one(docs, "Pod", f"{FULL}-smoke")["spec"]["containers"][0]
        script = smoke["args"][0].replace(f"http://{FULL}-gateway:8000", url)
        assert smoke["env"][0]["name"] == "API_KEYS"  # from the same Secret: the test sends a key too
        done = subprocess.run(
            [*smoke["command"], script], capture_output=True, text=True, timeout=60, env={**os.environ, "API_KEYS": keys}
        )
        assert done.returncode == 0, done.stderr
        assert '"object":"text_completion"' in done.stdout.replace(" ", "")
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        for key in index.scan_iter(prefix + "*"):
            index.delete(key)
