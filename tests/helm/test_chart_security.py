"""The chart's pods against the Pod Security Standards, and its processes under their own security contexts.

Every pod the release runs for the gateway, Redis, the Mooncake master, emulated workers and the
`helm test` pod must meet the "restricted" profile (tests/helm/pod_security.py); the vLLM / SGLang
engine pods must meet "baseline" and miss "restricted" only where the engines need it (documented in
values.yaml). Removing a security context from values makes these checks fail (tested too, so the
checks cannot pass vacuously). Then the rendered gateway, Mooncake master and Redis command lines run
here the way their containers would: read-only root filesystem with tmpfs only at their emptyDir
mount paths, the rendered runAsUser / runAsGroup, no capabilities, no_new_privs (tests/helm/sandbox.py).

There is no indexer component: the KV index lives in the gateways and the bundled Redis.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.helm import sandbox
from tests.helm.chart import FULL, STATIC, container, env, needs_helm, one, render, venv_exe, wait_http
from tests.helm.pod_security import baseline_violations, pod_of, restricted_violations
from tests.support.ci import require
from tests.support.servers import free_port

# components whose pods must meet "restricted" in every render
RESTRICTED = {"gateway", "redis", "mooncake-master", "smoke-test"}
ENGINE_ROLES = {"prefill", "decode", "mixed"}
# renders that, between them, turn on every optional pod and volume of those components
RENDERS = {
    "mooncake": ("pdProtocol=mooncake", "mixed.replicas=1"),
    "nixl": ("pdProtocol=nixl", "gateway.replicas=1"),
    "sglang": ("pdProtocol=sglang",),
    "emulated-hardened": (
        "workers.emulator.enabled=true",
        "gateway.kv.mooncakeStore=true",
        "gateway.adminPort=9090",
        "gateway.apiKeys={sk-a}",
        "gateway.autoscaling.enabled=true",
        "mooncakeMaster.kvEventsPort=5558",
        "monitoring.serviceMonitor.enabled=true",
    ),
}


def _pods(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(component, pod metadata, pod spec) of every manifest that runs a pod."""
    for doc in docs:
        pod = pod_of(doc)
        if pod is not None:
            yield doc["metadata"]["labels"]["app.kubernetes.io/component"], *pod


def _compliant_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    """A pod spec that meets every restricted control: the starting point of the checker's own test."""
    spec = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "image": "x",
                "ports": [{"containerPort": 80}],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                },
            }
        ],
        "volumes": [{"name": "v", "emptyDir": {}}, {"name": "s", "secret": {"secretName": "s"}}],
    }
    return {"annotations": {}}, spec


# (what to change in the compliant pod, the control it must be reported under)
MUTATIONS = [
    (lambda m, s: s.update(hostNetwork=True), "Host Namespaces"),
    (lambda m, s: s.update(hostPID=True), "Host Namespaces"),
    (lambda m, s: s.update(hostIPC=True), "Host Namespaces"),
    (lambda m, s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "HostPath Volumes"),
    (lambda m, s: s["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}), "Volume Types"),
    (lambda m, s: s["containers"][0]["securityContext"].update(privileged=True), "Privileged Containers"),
    (lambda m, s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "Privilege Escalation"),
    (lambda m, s: s["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True), "Privilege Escalation"),
    (lambda m, s: s["securityContext"].pop("runAsNonRoot"), "Running as Non-root"),
    (lambda m, s: s["containers"][0]["securityContext"].update(runAsNonRoot=False), "Running as Non-root"),
    (lambda m, s: s["containers"][0]["securityContext"].update(runAsUser=0), "Running as Non-root user"),
    (lambda m, s: s["securityContext"].pop("seccompProfile"), "Seccomp"),
    (lambda m, s: s["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"}), "Seccomp"),
    (lambda m, s: s["containers"][0]["securityContext"]["capabilities"].update(drop=[]), "Capabilities"),
    (lambda m, s: s["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "Capabilities"),
    (lambda m, s: s["containers"][0]["securityContext"]["capabilities"].update(add=["CHOWN"]), "Capabilities"),
    (lambda m, s: s["containers"][0]["ports"][0].update(hostPort=80), "Host Ports"),
    (lambda m, s: s["containers"][0]["securityContext"].update(procMount="Unmasked"), "/proc Mount Type"),
    (lambda m, s: s["securityContext"].update(seLinuxOptions={"type": "spc_t"}), "SELinux"),
    (lambda m, s: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "Sysctls"),
    (lambda m, s: s["securityContext"].update(windowsOptions={"hostProcess": True}), "HostProcess"),
    (lambda m, s: m["annotations"].update({"container.apparmor.security.beta.kubernetes.io/c": "unconfined"}), "AppArmor"),
    (lambda m, s: s.setdefault("initContainers", []).append({"name": "i", "image": "x"}), "Privilege Escalation"),
]


def test_checker_flags_each_restricted_rule() -> None:
    meta, spec = _compliant_pod()
    assert restricted_violations(meta, spec) == []
    for n, (mutate, control) in enumerate(MUTATIONS):
        m, s = copy.deepcopy(meta), copy.deepcopy(spec)
        mutate(m, s)
        found = restricted_violations(m, s)
        assert any(v.startswith(control + ":") for v in found), (n, control, found)


@needs_helm
@pytest.mark.parametrize("name", RENDERS)
def test_release_pods_meet_the_restricted_profile(name: str) -> None:
    docs = render(*RENDERS[name])
    emulated = "workers.emulator.enabled=true" in RENDERS[name]
    seen: set[str] = set()
    for component, meta, spec in _pods(docs):
        seen.add(component)
        if component in ENGINE_ROLES and not emulated:
            continue  # test_engine_pods_meet_baseline_and_miss_restricted_only_on_non_root
        assert restricted_violations(meta, spec) == [], component
        # not a Pod Security control, but nothing here calls the Kubernetes API: no token to steal
        assert spec["automountServiceAccountToken"] is False, component
    # nothing was skipped by a render that lacked it
    assert seen >= RESTRICTED, seen


@needs_helm
@pytest.mark.parametrize(
    ("component", "value_prefix"),
    [
        ("gateway", "gateway"),
        ("redis", "redis"),
        ("mooncake-master", "mooncakeMaster"),
        ("smoke-test", "helmTest"),
        ("prefill", "gateway"),  # emulated workers take the gateway's contexts
    ],
)
@pytest.mark.parametrize(
    ("field", "controls"),
    [
        ("podSecurityContext", {"Running as Non-root", "Seccomp"}),
        ("securityContext", {"Privilege Escalation", "Capabilities"}),
    ],
)
def test_removing_a_security_context_breaks_the_profile(
    component: str, value_prefix: str, field: str, controls: set[str]
) -> None:
    """What the profile test above would catch if a template or a values default lost a context."""
    docs = render("workers.emulator.enabled=true", f"{value_prefix}.{field}=null")
    [(meta, spec)] = [(m, s) for c, m, s in _pods(docs) if c == component]
    found = {v.split(":")[0] for v in restricted_violations(meta, spec)}
    assert controls <= found, found


@needs_helm
@pytest.mark.parametrize("protocol", ["nixl", "mooncake", "sglang"])
def test_engine_pods_meet_baseline_and_miss_restricted_only_on_non_root(protocol: str) -> None:
    """vLLM / SGLang images run as root and write caches under $HOME: only runAsNonRoot is left out."""
    docs = render(f"pdProtocol={protocol}", "mixed.replicas=1")
    engines = [(c, m, s) for c, m, s in _pods(docs) if c in ENGINE_ROLES]
    assert {c for c, _, _ in engines} == ENGINE_ROLES
    for component, meta, spec in engines:
        assert baseline_violations(meta, spec) == [], component
        missing = restricted_violations(meta, spec)
        assert missing and all(v.startswith("Running as Non-root:") for v in missing), (component, missing)
        c = spec["containers"][0]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        # shared memory through a memory-backed emptyDir, never hostIPC
        [shm] = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # an image with a user of its own: the operator adds runAsNonRoot and the pods are "restricted"
    hardened = render(
        f"pdProtocol={protocol}", "workers.podSecurityContext.runAsNonRoot=true", "workers.podSecurityContext.runAsUser=1000"
    )
    for component, meta, spec in _pods(hardened):
        if component in ENGINE_ROLES:
            assert restricted_violations(meta, spec) == [], component


@needs_helm
def test_rdma_adds_ipc_lock_and_leaves_baseline() -> None:
    docs = render("workers.rdma.ipcLock=true")
    for component, meta, spec in _pods(docs):
        if component in ENGINE_ROLES:
            caps = spec["containers"][0]["securityContext"]["capabilities"]
            assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
            assert baseline_violations(meta, spec) == ["Capabilities: containers[engine] adds ['IPC_LOCK']"]
        elif component in RESTRICTED:
            assert restricted_violations(meta, spec) == [], component


def _scratch_mounts(doc: dict[str, Any]) -> list[str]:
    """Mount paths of the container's emptyDir volumes: its only writable places."""
    spec = doc["spec"]["template"]["spec"]
    empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    return [m["mountPath"] for m in container(doc)["volumeMounts"] if m["name"] in empty]


@needs_helm
def test_read_only_root_filesystems_keep_their_scratch_directories() -> None:
    docs = render("workers.emulator.enabled=true")
    expected = {
        f"{FULL}-gateway": ["/tmp"],
        f"{FULL}-mooncake-master": ["/tmp"],
        f"{FULL}-redis": ["/data"],
        f"{FULL}-prefill": ["/dev/shm", "/models", "/tmp"],
    }
    for name, scratch in expected.items():
        doc = next(d for d in docs if d["metadata"]["name"] == name and d["kind"] in ("Deployment", "StatefulSet"))
        assert container(doc)["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert _scratch_mounts(doc) == scratch, name


# ---- the rendered processes under their security contexts -----------------------------------------


def _identity(doc: dict[str, Any]) -> tuple[int, int]:
    """runAsUser / runAsGroup the pod runs as, checked to be what the sandbox can reproduce."""
    pod_sc = doc["spec"]["template"]["spec"]["securityContext"]
    sc = container(doc)["securityContext"]
    # the sandbox applies exactly these: read-only root, no capabilities, no_new_privs
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["allowPrivilegeEscalation"] is False and "add" not in sc["capabilities"]
    return int(pod_sc["runAsUser"]), int(pod_sc["runAsGroup"])


needs_sandbox = pytest.mark.skipif(sandbox.available() is not None, reason=f"no sandbox: {sandbox.available()}")


@needs_helm
@needs_sandbox
def test_rendered_gateway_serves_under_its_security_context() -> None:
    """Non-root, read-only root with /tmp only, no capabilities: it starts, takes its API keys from the
    chart's Secret through CONDUCTOR_AUTH__API_KEYS, and serves /metrics on the admin port alone."""
    public, admin = free_port(), free_port()
    docs = render(
        STATIC,
        "gateway.apiKeys={sk-chart,12345}",
        f"gateway.adminPort={admin}",
        f"gateway.port={public}",
        "prefill.replicas=1",
        "decode.replicas=1",
    )
    dep = one(docs, "Deployment", f"{FULL}-gateway")
    c = container(dep)
    uid, gid = _identity(dep)
    secret = one(docs, "Secret", f"{FULL}-gateway-api-keys")
    ref = c["env"][[e["name"] for e in c["env"]].index("CONDUCTOR_AUTH__API_KEYS")]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    keys_json = base64.b64decode(secret["data"][ref["key"]]).decode()
    # the rendered settings file, readable by the pod's user: in Kubernetes a ConfigMap volume
    with tempfile.TemporaryDirectory(dir="/dev/shm") as where:
        os.chmod(where, 0o755)
        config = Path(where) / "config.yaml"
        config.write_text(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])
        config.chmod(0o644)
        args = [str(config) if a == "/etc/conductor/config.yaml" else a for a in c["args"]]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
        environ.update({k: v for k, v in env(c).items() if isinstance(v, str)})
        environ.update(
            CONDUCTOR_AUTH__API_KEYS=keys_json,
            CONDUCTOR_HOST="127.0.0.1",
            CONDUCTOR_LOAD_SHARE__REPLICA_ID="gw-sandbox",
            CONDUCTOR_LOAD_SHARE__REDIS_URL="redis://127.0.0.1:6379/14",
            CONDUCTOR_KV__REDIS_URL="redis://127.0.0.1:6379/14",
            CONDUCTOR_TIMEOUTS__BOOTSTRAP_S="0.5",
            CONDUCTOR_HEALTH__TIMEOUT_S="0.5",
        )
        exe = venv_exe(c["command"][0])
        assert exe
        proc = subprocess.Popen(
            sandbox.command([exe, *args], uid=uid, gid=gid, writable=_scratch_mounts(dep)),
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url, admin_url = f"http://127.0.0.1:{public}", f"http://127.0.0.1:{admin}"
            wait_http(url + "/health", proc)
            assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
            for key in ("sk-chart", "12345"):  # digits stay a string key
                r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
                assert r.status_code == 200, r.text
            assert httpx.get(url + "/metrics", timeout=5).status_code == 404
            assert "conductor_instance_healthy" in httpx.get(admin_url + "/metrics", timeout=5).text
        finally:
            proc.terminate()
            proc.wait(timeout=40)


@needs_helm
@needs_sandbox
def test_rendered_mooncake_master_serves_under_its_security_context() -> None:
    exe = venv_exe("mooncake_master")
    require(exe is not None, "no mooncake_master: pip install -e '.[mooncake]'")
    assert exe is not None
    rpc, metrics, meta = (free_port() for _ in range(3))
    docs = render(
        f"mooncakeMaster.rpcPort={rpc}", f"mooncakeMaster.metricsPort={metrics}", f"mooncakeMaster.httpMetadataServer.port={meta}"
    )
    dep = one(docs, "Deployment", f"{FULL}-mooncake-master")
    uid, gid = _identity(dep)
    proc = subprocess.Popen(
        sandbox.command([exe, *container(dep)["args"]], uid=uid, gid=gid, writable=_scratch_mounts(dep)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_http(f"http://127.0.0.1:{metrics}/health", proc).json()["service_ready"] is True
        assert httpx.get(f"http://127.0.0.1:{meta}/metadata", params={"key": "none"}, timeout=5).status_code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@needs_helm
@needs_sandbox
def test_rendered_redis_serves_under_its_security_context() -> None:
    exe = venv_exe("redis-server")
    require(exe is not None, "no redis-server on PATH (apt-get install redis-server)")
    assert exe is not None
    port = free_port()
    docs = render(f"redis.port={port}")
    dep = one(docs, "Deployment", f"{FULL}-redis")
    uid, gid = _identity(dep)
    c = container(dep)
    # the image's entrypoint adds redis-server before flags; started as uid 999 it switches no user
    proc = subprocess.Popen(
        sandbox.command([exe, *c["args"]], uid=uid, gid=gid, writable=[], python=False),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, "redis-server exited"
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.1)
        # works with no writable directory at all (the /data emptyDir is a spare): nothing saved
        assert client.set("k", "v") and client.get("k") == b"v"
        assert client.config_get("save") == {"save": ""} and client.config_get("appendonly") == {"appendonly": "no"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_pod_security_checker_reads_every_pod_kind() -> None:
    spec: dict[str, Any] = {"containers": []}
    for doc in (
        {"kind": "Pod", "metadata": {}, "spec": spec},
        {"kind": "Deployment", "spec": {"template": {"metadata": {}, "spec": spec}}},
        {"kind": "StatefulSet", "spec": {"template": {"spec": spec}}},
        {"kind": "Job", "spec": {"template": {"spec": spec}}},
        {"kind": "CronJob", "spec": {"jobTemplate": {"spec": {"template": {"spec": spec}}}}},
    ):
        found = pod_of(doc)
        assert found is not None and found[1] is spec, doc["kind"]
    assert pod_of({"kind": "Service", "spec": {}}) is None
