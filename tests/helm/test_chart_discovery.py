"""The chart with gateway.discovery.enabled: the gateway's settings name each role's headless Service
instead of listing pods, the gateway accepts them, and the autoscaled gateway still validates."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conductor.config.settings import load_settings
from conductor.core.types import Role
from tests.helm.chart import FULL, NAMESPACE, container, gateway_config, needs_helm, one, ports, render
from tests.support.ci import require_import

pytestmark = needs_helm


@pytest.mark.parametrize("protocol", ["nixl", "mooncake"])
def test_discovery_names_the_headless_services(protocol: str, tmp_path: Path) -> None:
    docs = render(
        "gateway.discovery.enabled=true",
        "gateway.discovery.intervalSeconds=3",
        f"pdProtocol={protocol}",
        "prefill.replicas=2",
        "decode.replicas=1",
    )
    cfg = gateway_config(docs)
    assert "prefill" not in cfg and "decode" not in cfg  # no pod list: DNS says who is there
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    settings = load_settings(tmp_path / "config.yaml", environ={})  # the gateway accepts it as is
    assert settings.disaggregated and settings.discovery.interval_s == 3
    sources = settings.discovery.sources()
    assert set(sources) == {Role.PREFILL, Role.DECODE}
    for role, source in sources.items():
        svc = one(docs, "Service", f"{FULL}-{role.value}")
        sts = one(docs, "StatefulSet", f"{FULL}-{role.value}")
        assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert source.name == f"{FULL}-{role.value}.{NAMESPACE}.svc.cluster.local"
        p = ports(container(sts))
        assert source.port == p["http"]
        if role is Role.PREFILL:
            assert source.kv_events_port == p["kv-events"]
            assert source.bootstrap_port == (p["bootstrap"] if protocol == "mooncake" else None)
        else:
            assert source.kv_events_port is None and source.bootstrap_port is None
    # the worker tokenizer has no listed instance to default to: the prefill Service stands in
    assert settings.kv.tokenizer_url == f"http://{FULL}-prefill.{NAMESPACE}.svc.cluster.local:{sources[Role.PREFILL].port}"


def test_mixed_workers_by_discovery() -> None:
    cfg = gateway_config(render("gateway.discovery.enabled=true", "prefill.replicas=0", "decode.replicas=0", "mixed.replicas=2"))
    assert set(cfg["discovery"]) == {"mixed", "interval_s"} and "mixed" not in cfg
    assert cfg["kv"]["tokenizer_url"].startswith(f"http://{FULL}-mixed.")


def test_the_autoscaled_gateway_with_discovery_validates() -> None:
    kv = require_import("kubernetes_validate", "the test extra installs kubernetes-validate")
    docs = render("gateway.discovery.enabled=true", "gateway.autoscaling.enabled=true")
    hpa = one(docs, "HorizontalPodAutoscaler", f"{FULL}-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{FULL}-gateway"
    assert "replicas" not in one(docs, "Deployment", f"{FULL}-gateway")["spec"]  # left to the autoscaler
    for doc in docs:
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "gateway.networking.k8s.io/")):
            continue
        kv.validate(doc, "1.33.0", strict=True)
