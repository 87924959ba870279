"""The Helm chart, rendered by a real helm: the gateway's settings name every prefill/decode pod the
StatefulSets create (with the bootstrap port where the protocol needs one), the engines carry the
matching connector flags, the gateway accepts the rendered settings (parsed by conductor.config.settings),
probes, Redis, ServiceMonitors and the dashboards ConfigMap are right, and every manifest validates
against the Kubernetes 1.33 schemas. test_chart_run.py runs the rendered command lines.

Needs a helm binary on PATH or at .ci/bin/helm (`bash .ci/helm.sh` puts one there); skipped with
that hint otherwise, failed under CI (tests/support/ci.py). The dashboards' own checks are in
test_dashboards.py and need no helm.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml

from conductor.config.legacy import DeprecatedSettingWarning
from conductor.config.settings import load_settings
from tests.helm.chart import (
    CHART,
    FULL,
    HELM,
    NAMESPACE,
    ROOT,
    STATIC,
    container,
    env,
    flag,
    gateway_config,
    helm,
    needs_helm,
    one,
    ports,
    render,
)
from tests.support.ci import require_import

pytestmark = needs_helm


def test_lint_default_and_each_protocol() -> None:
    for sets in (
        "pdProtocol=nixl",
        "pdProtocol=mooncake",
        "pdProtocol=sglang",
        "workers.emulator.enabled=true,gateway.kv.mooncakeStore=true,monitoring.serviceMonitor.enabled=true",
    ):
        out = helm("lint", "--strict", str(CHART), "--set", sets)
        assert "0 chart(s) failed" in out


def test_schema_rejects_bad_values() -> None:
    assert HELM is not None
    for bad, where in (
        ("pdProtocol=tcp", "pdProtocol"),
        ("gateway.slo.ttftSeconds=soon", "ttftSeconds"),
        ("prefill.replicas=-1", "replicas"),
        ("gateway.replicas=0", "replicas"),
    ):
        done = subprocess.run([HELM, "template", "rel", str(CHART), "--set", bad], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and where in done.stderr, bad


@pytest.mark.parametrize(("protocol", "n_prefill", "n_decode"), [("nixl", 1, 1), ("mooncake", 3, 2), ("sglang", 2, 3)])
def test_gateway_lists_every_pod_and_engines_agree(protocol: str, n_prefill: int, n_decode: int, tmp_path: Path) -> None:
    docs = render(
        STATIC,
        f"pdProtocol={protocol}",
        f"prefill.replicas={n_prefill}",
        f"decode.replicas={n_decode}",
        "gateway.slo.ttftSeconds=2.5",
        "gateway.config.timeouts.read_s=33",
    )
    cfg = gateway_config(docs)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedSettingWarning)  # and finds no old flat key in it
        settings = load_settings(tmp_path / "config.yaml", environ={})  # the gateway accepts it as is
    assert settings.pd.protocol == protocol
    assert (settings.slo.ttft_s, settings.slo.tbt_s, settings.timeouts.read_s) == (2.5, None, 33)
    assert [s.name for s in settings.prefill] == [f"prefill-{i}" for i in range(n_prefill)]
    assert [s.name for s in settings.decode] == [f"decode-{i}" for i in range(n_decode)]
    for role, specs, n in (("prefill", settings.prefill, n_prefill), ("decode", settings.decode, n_decode)):
        sts = one(docs, "StatefulSet", f"{FULL}-{role}")
        svc = one(docs, "Service", f"{FULL}-{role}")
        assert sts["spec"]["replicas"] == n and sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        c = container(sts)
        args, p = c["args"], ports(c)
        for i, spec in enumerate(specs):  # pod i of the StatefulSet, through the headless Service
            host = f"{FULL}-{role}-{i}.{FULL}-{role}.{NAMESPACE}.svc.cluster.local"
            assert spec.url == f"http://{host}:{p['http']}"
            if role == "prefill" and protocol != "nixl":
                assert spec.bootstrap_port == p["bootstrap"] and "bootstrap" in {q["name"] for q in svc["spec"]["ports"]}
            else:
                assert spec.bootstrap_port is None
            if role == "prefill":
                events = json.loads(flag(args, "--kv-events-config"))
                assert events["endpoint"] == f"tcp://*:{p['kv-events']}" and events["publisher"] == "zmq"
                # the engine's own endpoint: "*" = it binds, each gateway replica connects to the pod
                assert spec.kv_events_endpoint == events["endpoint"]
            else:
                assert spec.kv_events_endpoint is None and "--kv-events-config" not in args
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        if protocol == "sglang":
            assert c["command"] == ["python3", "-m", "sglang.launch_server"]
            assert flag(args, "--disaggregation-mode") == role
            assert flag(args, "--page-size") == str(settings.block_size)
            if role == "prefill":
                assert int(flag(args, "--disaggregation-bootstrap-port")) == specs[0].bootstrap_port
            assert "--kv-transfer-config" not in args
            continue
        assert c["command"] == ["vllm", "serve"]
        kv = json.loads(flag(args, "--kv-transfer-config"))
        assert kv["kv_connector"] == {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}[protocol]
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert "--enable-prefix-caching" in args
        assert flag(args, "--block-size") == str(settings.block_size)
        assert [flag(args, "--served-model-name")] == list(settings.models)
        e = env(c)
        assert e["VLLM_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        if protocol == "mooncake":
            assert ("VLLM_MOONCAKE_BOOTSTRAP_PORT" in e) == (role == "prefill")
            if role == "prefill":
                assert int(e["VLLM_MOONCAKE_BOOTSTRAP_PORT"]) == specs[0].bootstrap_port
        else:
            assert int(e["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == p["nixl"]
            assert e["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_gateway_deployment_probes_config_mount_and_redis(tmp_path: Path) -> None:
    docs = render("gateway.replicas=3")
    dep = one(docs, "Deployment", f"{FULL}-gateway")
    assert dep["spec"]["replicas"] == 3
    c = container(dep)
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    config_path = Path(flag(c["args"], "--config"))
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert str(config_path.parent) == mount["mountPath"]
    [vol] = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    assert config_path.name in one(docs, "ConfigMap", vol["configMap"]["name"])["data"]
    e = env(c)
    assert e["CONDUCTOR_LOAD_SHARE__REDIS_URL"] == f"redis://{FULL}-redis:6379/0" and e["CONDUCTOR_LOAD_SHARE__MODE"] == "redis"
    # the env names are real settings fields (unknown CONDUCTOR_* variables are ignored silently)
    (tmp_path / "config.yaml").write_text(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])
    literal = {k: v for k, v in e.items() if isinstance(v, str)} | {"CONDUCTOR_LOAD_SHARE__REPLICA_ID": "gw-0"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedSettingWarning)  # every variable by its current name
        settings = load_settings(tmp_path / "config.yaml", environ=literal)
    assert (settings.load_share.mode, settings.load_share.redis_url, settings.load_share.replica_id) == (
        "redis",
        e["CONDUCTOR_LOAD_SHARE__REDIS_URL"],
        "gw-0",
    )
    # KV awareness on, with the index shared in the same Redis
    assert (settings.kv.enabled, settings.kv.tokenizer, settings.kv.index) == (True, "worker", "redis")
    assert settings.kv.redis_url == e["CONDUCTOR_LOAD_SHARE__REDIS_URL"] and settings.kv.mooncake is None
    redis_svc = one(docs, "Service", f"{FULL}-redis")
    assert redis_svc["spec"]["ports"][0]["port"] == 6379
    assert "--maxmemory" in container(one(docs, "Deployment", f"{FULL}-redis"))["args"]  # bounded
    assert "checksum/config" in dep["spec"]["template"]["metadata"]["annotations"]

    external = render("redis.enabled=false", "redis.externalUrl=redis://cache.infra:6379/2")
    assert not [d for d in external if d["metadata"]["name"] == f"{FULL}-redis"]
    assert (
        env(container(one(external, "Deployment", f"{FULL}-gateway")))["CONDUCTOR_LOAD_SHARE__REDIS_URL"]
        == "redis://cache.infra:6379/2"
    )
    assert gateway_config(external)["kv"]["redis_url"] == "redis://cache.infra:6379/2"
    no_redis = render("redis.enabled=false", "gateway.replicas=1")
    assert gateway_config(no_redis)["kv"]["index"] == "memory"
    assert "CONDUCTOR_LOAD_SHARE__REDIS_URL" not in env(container(one(no_redis, "Deployment", f"{FULL}-gateway")))


def test_mooncake_store_probe_points_at_the_master(tmp_path: Path) -> None:
    docs = render("gateway.kv.mooncakeStore=true", "model.servedName=qwen")
    (tmp_path / "config.yaml").write_text(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])
    settings = load_settings(tmp_path / "config.yaml", environ={"CONDUCTOR_KV__MOONCAKE__LOCAL_HOSTNAME": "10.1.2.3"})
    store = settings.kv.mooncake
    assert store is not None and settings.kv.key_mode == "vllm"
    master = one(docs, "Service", f"{FULL}-mooncake-master")
    svc_ports = {p["name"]: p["port"] for p in master["spec"]["ports"]}
    assert store.master == f"{FULL}-mooncake-master:{svc_ports['rpc']}"
    assert store.metadata_server == f"http://{FULL}-mooncake-master:{svc_ports['metadata']}/metadata"
    assert (store.model, store.local_hostname) == ("qwen", "10.1.2.3")
    gw_env = env(container(one(docs, "Deployment", f"{FULL}-gateway")))
    assert gw_env["CONDUCTOR_KV__MOONCAKE__LOCAL_HOSTNAME"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_gateway_disruption_budget_only_with_several_replicas() -> None:
    docs = render("gateway.replicas=3")
    pdb = one(docs, "PodDisruptionBudget", f"{FULL}-gateway")
    pod_labels = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["minAvailable"] == 1 and pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert not [d for d in render("gateway.replicas=1") if d["kind"] == "PodDisruptionBudget"]


def test_mixed_workers_only_and_mooncake_master() -> None:
    docs = render(STATIC, "prefill.replicas=0", "decode.replicas=0", "mixed.replicas=2")
    cfg = gateway_config(docs)
    assert "prefill" not in cfg and "decode" not in cfg
    assert [m["name"] for m in cfg["mixed"]] == ["mixed-0", "mixed-1"]
    assert not [d for d in docs if d["metadata"]["name"] in (f"{FULL}-prefill", f"{FULL}-decode")]
    args = container(one(docs, "StatefulSet", f"{FULL}-mixed"))["args"]
    assert "--kv-transfer-config" not in args and "--kv-events-config" in args
    master = container(one(docs, "Deployment", f"{FULL}-mooncake-master"))
    assert master["command"] == ["mooncake_master"]
    assert "--enable_http_metadata_server=true" in master["args"]
    assert ports(master) == {"rpc": 50051, "metrics": 9003, "metadata": 8080}


def test_dashboards_configmap_carries_every_dashboard() -> None:
    docs = render()
    cm = one(docs, "ConfigMap", f"{FULL}-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p for p in (ROOT / "grafana").glob("*.json")}
    assert set(cm["data"]) == set(files) and files
    for name, text in cm["data"].items():
        assert json.loads(text) == json.loads(files[name].read_text())
    assert not [d for d in render("monitoring.dashboards.enabled=false") if d["metadata"]["name"] == cm["metadata"]["name"]]


def test_service_monitors_keep_the_gateways_instance_label() -> None:
    docs = render("monitoring.serviceMonitor.enabled=true", "monitoring.serviceMonitor.labels.release=kps")
    gw = one(docs, "ServiceMonitor", f"{FULL}-gateway")
    assert gw["spec"]["endpoints"][0]["honorLabels"] is True
    assert gw["metadata"]["labels"]["release"] == "kps"
    gw_labels = one(docs, "Service", f"{FULL}-gateway")["metadata"]["labels"]
    assert gw["spec"]["selector"]["matchLabels"].items() <= gw_labels.items()
    workers = one(docs, "ServiceMonitor", f"{FULL}-workers")
    for role in ("prefill", "decode"):
        labels = one(docs, "Service", f"{FULL}-{role}")["metadata"]["labels"]
        assert workers["spec"]["selector"]["matchLabels"].items() <= labels.items()


# Kubernetes minors the chart is validated against (kubernetes-validate ships their schemas)
KUBERNETES_VERSIONS = ("1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")
# kinds from CRDs (Prometheus Operator, Gateway API): not in the Kubernetes schemas; their fields are
# checked by test_chart_operations.py and test_service_monitors_keep_the_gateways_instance_label
CRD_GROUPS = ("monitoring.coreos.com/", "gateway.networking.k8s.io/")


def test_manifests_validate_against_kubernetes_schemas() -> None:
    kv = require_import("kubernetes_validate", "the test extra installs kubernetes-validate")
    renders = [
        render(f"pdProtocol={protocol}", "mixed.replicas=1", "mooncakeMaster.kvEventsPort=5558")
        for protocol in ("nixl", "mooncake", "sglang")
    ]
    renders.append(render("workers.emulator.enabled=true", "gateway.kv.mooncakeStore=true"))
    # every optional production piece at once: Secret, admin Service, HPA, Ingress, RDMA capability
    renders.append(
        render(
            "gateway.apiKeys={sk-1}",
            "gateway.adminPort=9090",
            "gateway.autoscaling.enabled=true",
            "ingress.enabled=true",
            "ingress.tls[0].secretName=tls",
            "ingress.tls[0].hosts[0]=a.example",
            "httpRoute.enabled=true",
            "httpRoute.parentRefs[0].name=gw",
            "workers.rdma.ipcLock=true",
            "monitoring.serviceMonitor.enabled=true",
        )
    )
    kinds = set()
    for docs in renders:
        for doc in docs:
            if doc["apiVersion"].startswith(CRD_GROUPS):
                continue
            kinds.add(doc["kind"])
            for version in KUBERNETES_VERSIONS:
                kv.validate(doc, version, strict=True)
    assert {"Secret", "HorizontalPodAutoscaler", "Ingress", "Deployment", "StatefulSet", "Pod"} <= kinds
