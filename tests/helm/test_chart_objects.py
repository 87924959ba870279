"""The chart deploys as it is (issue 35): three whole releases validate strictly (emulated fleet, P/D with
Redis and replicas, gateway-only by DNS), and the objects around the gateway are right: NetworkPolicy,
ServiceAccount, topology spread, key Secrets mounted as files, PrometheusRule on exported metrics, no
`latest` image. `helm test` itself needs a cluster; templates/tests/smoke.yaml is run against a local
gateway by tests/helm/test_chart_run.py."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from conductor.config.settings import load_settings
from conductor.core.block_keys import XxhashKeys
from conductor.kv.agreement import HashAgreement
from conductor.kv.event_metrics import KVEventsCollector
from conductor.ops.metrics import GatewayMetrics
from tests.helm.chart import FULL, NAMESPACE, gateway_config, needs_helm, one, render
from tests.support.ci import require_import

pytestmark = needs_helm

CRDS = ("monitoring.coreos.com/", "gateway.networking.k8s.io/")
GATEWAY_ONLY = (
    "prefill.replicas=0",
    "decode.replicas=0",
    "redis.enabled=false",
    "mooncakeMaster.enabled=false",
    "gateway.config.discovery.prefill.name=prefill.fleet.svc.cluster.local",
    "gateway.config.discovery.prefill.port=8000",
    "gateway.config.discovery.prefill.bootstrap_port=8998",  # pdProtocol mooncake: decode pulls from there
    "gateway.config.discovery.decode.name=decode.fleet.svc.cluster.local",
    "gateway.config.discovery.decode.port=8000",
)
RELEASES = {
    "emulated": ("workers.emulator.enabled=true",),
    "pd-redis-replicas": ("gateway.replicas=3", "prefill.replicas=3", "decode.replicas=2", "redis.enabled=true"),
    "gateway-only-dns": GATEWAY_ONLY,
}


def _validate(docs: list[dict[str, Any]]) -> None:
    kv = require_import("kubernetes_validate", "the test extra installs kubernetes-validate")
    for doc in docs:
        if not doc["apiVersion"].startswith(CRDS):
            kv.validate(doc, "1.33.0", strict=True)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_release_validates_strictly(release: str, tmp_path: Path) -> None:
    docs = render(*RELEASES[release], "gateway.networkPolicy.enabled=true", "monitoring.prometheusRule.enabled=true")
    _validate(docs)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(gateway_config(docs)))
    load_settings(tmp_path / "config.yaml", environ={})  # and the gateway accepts its settings


def test_gateway_only_by_dns_names_no_missing_service_and_no_model(tmp_path: Path) -> None:
    docs = render(*GATEWAY_ONLY)
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    cfg = gateway_config(docs)
    assert "models" not in cfg  # the fleet's /v1/models says what it serves, not model.name
    # the worker tokenizer asks the fleet's own prefill Service, not a <fullname>-mixed that does not exist
    assert cfg["kv"]["tokenizer_url"] == "http://prefill.fleet.svc.cluster.local:8000"
    assert not any(name in cfg["kv"]["tokenizer_url"] for name in services)
    # the smoke test asks for a model the gateway lists, not model.name
    smoke = one(docs, "Pod", f"{FULL}-smoke")["spec"]["containers"][0]["args"][0]
    assert "Qwen" not in smoke and '"id"' in smoke


def test_gateway_only_with_the_auto_tokenizer_asks_the_fleet_too() -> None:
    cfg = gateway_config(render(*GATEWAY_ONLY, "gateway.kv.tokenizer=auto"))
    assert cfg["kv"]["tokenizer_url"] == "http://prefill.fleet.svc.cluster.local:8000"


def test_gateway_only_keeps_models_and_tokenizer_the_user_gives() -> None:
    cfg = gateway_config(render(*GATEWAY_ONLY, "gateway.config.models={m1}", "gateway.config.kv.tokenizer_url=http://tok:1"))
    assert cfg["models"] == ["m1"] and cfg["kv"]["tokenizer_url"] == "http://tok:1"


def test_the_chart_s_own_workers_name_the_served_model() -> None:
    assert gateway_config(render())["models"] == ["Qwen/Qwen3-8B"]


def test_no_image_is_latest_or_untagged() -> None:
    for sets in [*RELEASES.values(), ("pdProtocol=sglang",), ("pdProtocol=nixl",)]:
        docs = render(*sets)
        images = re.findall(r"image: \"?([^\s\"]+)", yaml.safe_dump_all(docs))
        assert images
        for image in images:
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image


def test_network_policy_admin_port_only_from_monitoring() -> None:
    assert not [d for d in render() if d["kind"] == "NetworkPolicy"]  # off by default
    docs = render("gateway.networkPolicy.enabled=true", "gateway.adminPort=9000")
    np = one(docs, "NetworkPolicy", f"{FULL}-gateway")["spec"]
    assert np["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    by_port = {rule["ports"][0]["port"]: rule for rule in np["ingress"]}
    assert "from" not in by_port["http"]  # the public API: from anywhere by default
    (peer,) = by_port["admin"]["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    egress_ports = [p["port"] for rule in np["egress"] for p in rule.get("ports", [])]
    assert 53 in egress_ports
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "rel"}}} in np["egress"][0]["to"]


def test_service_account_has_no_token_and_replicas_spread() -> None:
    docs = render()
    sa = one(docs, "ServiceAccount", f"{FULL}-gateway")
    assert sa["automountServiceAccountToken"] is False
    pod = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{FULL}-gateway" and pod["automountServiceAccountToken"] is False
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    labels = pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == "gateway"


def test_admin_and_upstream_keys_are_secret_files_the_gateway_reads(tmp_path: Path) -> None:
    docs = render("gateway.adminKeys.keys={adm-1,adm-2}", "gateway.upstreamKey.value=up-key")
    cfg = gateway_config(docs)
    assert "adm-1" not in yaml.safe_dump(cfg) and "up-key" not in yaml.safe_dump(cfg)  # not in the ConfigMap
    pod = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for vol, secret, setting in (
        ("admin-keys", f"{FULL}-gateway-admin-keys", "admin_api_keys_file"),
        ("upstream-key", f"{FULL}-gateway-upstream-key", "upstream_api_key_file"),
    ):
        assert volumes[vol]["secret"]["secretName"] == secret
        mount, key = cfg["auth"][setting].rsplit("/", 1)
        assert mounts[vol] == mount
        data = base64.b64decode(one(docs, "Secret", secret)["data"][key])
        (tmp_path / key).write_bytes(data)  # the file the kubelet would project there
        cfg["auth"][setting] = str(tmp_path / key)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    auth = load_settings(tmp_path / "config.yaml", environ={}).auth
    assert auth.admin_keys() == {"adm-1", "adm-2"} and auth.upstream_key() == "up-key"
    existing = render("gateway.adminKeys.existingSecret=vault-admin")
    assert not [d for d in existing if d["kind"] == "Secret"]
    volumes = {v["name"]: v for v in one(existing, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-keys"]["secret"]["secretName"] == "vault-admin"


def _exported_series() -> set[str]:
    """Every series name the gateway exports: GatewayMetrics, the KV event feeds, the hash agreement."""
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    HashAgreement(registry)
    feeds = KVEventsCollector((), IndexFeeder(MemoryIndex(), XxhashKeys(16), translate=True), ())
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    families = [*registry.collect(), *feeds.describe()]
    return {f.name + s for f in families for s in suffixes.get(f.type, ("",))}


def test_prometheus_rule_alerts_on_metrics_the_gateway_exports() -> None:
    rule = one(render("monitoring.prometheusRule.enabled=true"), "PrometheusRule", f"{FULL}-gateway")
    rules = rule["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {
        "ConductorKvHashDisagreement",
        "ConductorInstanceEjections",
        "ConductorSloAttainmentLow",
        "ConductorHigh429Rate",
        "ConductorKvEventsSilent",
    }
    exported = _exported_series()
    for r in rules:
        names = set(re.findall(r"\bconductor_\w+", r["expr"]))
        assert names and names <= exported, (r["alert"], names - exported)
        assert f'namespace="{NAMESPACE}"' in r["expr"]
    slo = next(r for r in rules if r["alert"] == "ConductorSloAttainmentLow")["expr"]
    assert 'le="2.5"' in slo and 2.5 in GatewayMetrics().ttft._bounds  # one of the histogram's bucket bounds


def test_the_autoscaler_can_add_a_per_pod_gateway_metric() -> None:
    docs = render("gateway.autoscaling.enabled=true", "gateway.autoscaling.podsMetric.name=conductor_requests_per_second")
    _validate(docs)
    metrics = one(docs, "HorizontalPodAutoscaler", f"{FULL}-gateway")["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Resource", "Pods"]  # CPU stays; the higher demand wins
    assert metrics[1]["pods"]["metric"]["name"] == "conductor_requests_per_second"
    only_cpu = one(render("gateway.autoscaling.enabled=true"), "HorizontalPodAutoscaler", f"{FULL}-gateway")
    assert [m["type"] for m in only_cpu["spec"]["metrics"]] == ["Resource"]
