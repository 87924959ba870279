"""The chart's production wiring, rendered by a real helm: API keys from a Secret (never the ConfigMap),
the admin port on a Service of its own and scraped there, the preStop hook and a termination grace
period that covers the gateway's drain, the HorizontalPodAutoscaler, and the Ingress / HTTPRoute.
Settings are checked with the gateway's own loader, so a renamed setting or variable fails here.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from conductor.config.legacy import DeprecatedSettingWarning
from conductor.config.settings import load_settings
from tests.helm.chart import CHART, FULL, HELM, container, env, gateway_config, needs_helm, one, render

pytestmark = needs_helm


def _settings(
    docs: list[dict[str, Any]], tmp_path: Path, environ: dict[str, str] | None = None, deprecated: tuple[str, ...] = ()
) -> Any:
    """The gateway's settings from the rendered chart; only the `deprecated` (old flat) keys a test
    gives in gateway.config may warn: what the chart itself renders is all current."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(gateway_config(docs)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = load_settings(tmp_path / "config.yaml", environ=environ or {})
    moved = [str(w.message).split("'")[1] for w in caught if issubclass(w.category, DeprecatedSettingWarning)]
    assert moved == list(deprecated)
    return settings


def _refused(*sets: str) -> str:
    assert HELM is not None
    flags = [f for s in sets for f in ("--set", s)]
    done = subprocess.run([HELM, "template", "rel", str(CHART), *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, f"{sets} rendered"
    return done.stderr


def _env_entry(c: dict[str, Any], name: str) -> dict[str, Any]:
    [entry] = [e for e in c.get("env", []) if e["name"] == name]
    return entry


def test_api_keys_live_in_a_secret_the_gateway_reads(tmp_path: Path) -> None:
    docs = render("gateway.apiKeys={sk-team-a,0042}")
    secret = one(docs, "Secret", f"{FULL}-gateway-api-keys")
    dep = one(docs, "Deployment", f"{FULL}-gateway")
    ref = _env_entry(container(dep), "CONDUCTOR_AUTH__API_KEYS")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-keys"}
    value = base64.b64decode(secret["data"]["api-keys"]).decode()
    assert json.loads(value) == ["sk-team-a", "0042"]  # a JSON list, every key a string
    # the gateway's loader, given the variable as the kubelet would set it
    settings = _settings(docs, tmp_path, {"CONDUCTOR_AUTH__API_KEYS": value})
    assert [k.get_secret_value() for k in settings.auth.api_keys] == ["sk-team-a", "0042"]
    # nowhere in plain text: not the ConfigMap, not the pod spec
    plain = yaml.safe_dump([d for d in docs if d["kind"] != "Secret"])
    assert "sk-team-a" not in plain
    # a new key rolls the gateways
    rotated = one(render("gateway.apiKeys={sk-team-b}"), "Deployment", f"{FULL}-gateway")
    annotation = "checksum/api-keys"
    assert (
        rotated["spec"]["template"]["metadata"]["annotations"][annotation]
        != dep["spec"]["template"]["metadata"]["annotations"][annotation]
    )
    # `helm test` authenticates with the same Secret
    smoke = one(docs, "Pod", f"{FULL}-smoke")["spec"]["containers"][0]
    assert _env_entry(smoke, "API_KEYS")["valueFrom"]["secretKeyRef"] == ref


def test_api_keys_from_an_existing_secret() -> None:
    docs = render("gateway.apiKeysSecret.name=llm-keys", "gateway.apiKeysSecret.key=keys.json")
    assert not [d for d in docs if d["kind"] == "Secret"]
    c = container(one(docs, "Deployment", f"{FULL}-gateway"))
    assert _env_entry(c, "CONDUCTOR_AUTH__API_KEYS")["valueFrom"]["secretKeyRef"] == {"name": "llm-keys", "key": "keys.json"}
    # without keys, no variable: the gateway then serves without authentication
    assert "CONDUCTOR_AUTH__API_KEYS" not in env(container(one(render(), "Deployment", f"{FULL}-gateway")))


def test_plain_text_and_ambiguous_api_keys_are_refused() -> None:
    assert "plain text" in _refused("gateway.config.auth.api_keys={sk-1}")
    assert "plain text" in _refused("gateway.config.api_keys={sk-1}")  # the old flat key as well
    assert "not both" in _refused("gateway.apiKeys={sk-1}", "gateway.apiKeysSecret.name=other")


def test_admin_port_gets_its_own_service_and_the_scrape(tmp_path: Path) -> None:
    docs = render("gateway.adminPort=9090", "monitoring.serviceMonitor.enabled=true", "gateway.service.type=LoadBalancer")
    assert _settings(docs, tmp_path).admin_port == 9090
    dep = one(docs, "Deployment", f"{FULL}-gateway")
    c = container(dep)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "admin": 9090}
    public = one(docs, "Service", f"{FULL}-gateway")
    admin = one(docs, "Service", f"{FULL}-gateway-admin")
    # the public Service (here a load balancer) does not carry /metrics and /docs out of the cluster
    assert [p["name"] for p in public["spec"]["ports"]] == ["http"]
    assert admin["spec"]["type"] == "ClusterIP" and admin["spec"]["ports"] == [
        {"name": "admin", "port": 9090, "targetPort": "admin"}
    ]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9090"
    monitor = one(docs, "ServiceMonitor", f"{FULL}-gateway")
    assert monitor["spec"]["endpoints"][0]["port"] == "admin"
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    assert selector <= admin["metadata"]["labels"].items() and not selector <= public["metadata"]["labels"].items()
    # gateway.config.admin_port counts as well: the chart reads the final settings
    via_config = render("gateway.config.admin_port=9191")
    assert one(via_config, "Service", f"{FULL}-gateway-admin")["spec"]["ports"][0]["port"] == 9191
    # without it, the public port is scraped
    plain = render("monitoring.serviceMonitor.enabled=true")
    assert one(plain, "ServiceMonitor", f"{FULL}-gateway")["spec"]["endpoints"][0]["port"] == "http"
    assert not [d for d in plain if d["metadata"]["name"] == f"{FULL}-gateway-admin"]
    assert "must differ" in _refused("gateway.adminPort=8000")


@pytest.mark.parametrize(
    ("sets", "drain", "sleep", "margin"),
    [
        ((), 30.0, 5, 10),
        (("gateway.drainGraceSeconds=120", "gateway.shutdown.preStopSleepSeconds=8"), 120.0, 8, 10),
        (("gateway.config.timeouts.drain_grace_s=45.5", "gateway.shutdown.marginSeconds=3"), 45.5, 5, 3),
        # the old flat key still counts, for the grace period and the gateway (which warns)
        (("gateway.config.drain_grace_s=50.5", "gateway.shutdown.marginSeconds=3"), 50.5, 5, 3),
    ],
)
def test_termination_grace_covers_prestop_and_drain(
    sets: tuple[str, ...], drain: float, sleep: int, margin: int, tmp_path: Path
) -> None:
    docs = render(*sets)
    old = tuple(s.split(".")[2].split("=")[0] for s in sets if s.startswith("gateway.config.drain_grace_s"))
    settings = _settings(docs, tmp_path, deprecated=old)
    assert settings.timeouts.drain_grace_s == drain  # the gateway drains this long after SIGTERM
    pod = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": sleep}}
    # the kubelet's clock starts at preStop: sleep, then the drain, then the margin before SIGKILL
    assert pod["terminationGracePeriodSeconds"] == math.ceil(sleep + drain + margin)


def test_prestop_before_kubernetes_1_30_uses_the_images_sleep() -> None:
    assert HELM is not None
    out = subprocess.run(
        [HELM, "template", "rel", str(CHART), "--kube-version", "1.29.0"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    dep = one([d for d in yaml.safe_load_all(out) if d], "Deployment", f"{FULL}-gateway")
    assert container(dep)["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    no_sleep = one(render("gateway.shutdown.preStopSleepSeconds=0"), "Deployment", f"{FULL}-gateway")
    assert "lifecycle" not in container(no_sleep)


def test_gateway_autoscaler() -> None:
    docs = render(
        "gateway.autoscaling.enabled=true",
        "gateway.autoscaling.minReplicas=3",
        "gateway.autoscaling.maxReplicas=12",
        "gateway.autoscaling.targetCPUUtilizationPercentage=60",
    )
    hpa = one(docs, "HorizontalPodAutoscaler", f"{FULL}-gateway")
    dep = one(docs, "Deployment", f"{FULL}-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["metrics"] == [
        {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}
    ]
    # utilization is relative to the request, which must be there
    assert container(dep)["resources"]["requests"]["cpu"]
    # the autoscaler owns the count; an upgrade must not reset it
    assert "replicas" not in dep["spec"]
    # replicas it may add share load through Redis, and the budget follows its minimum
    assert env(container(dep))["CONDUCTOR_LOAD_SHARE__MODE"] == "redis"
    assert one(docs, "PodDisruptionBudget", f"{FULL}-gateway")["spec"]["minAvailable"] == 1
    single = render("gateway.autoscaling.enabled=true", "gateway.autoscaling.minReplicas=1", "gateway.replicas=1")
    assert env(container(one(single, "Deployment", f"{FULL}-gateway")))["CONDUCTOR_LOAD_SHARE__MODE"] == "redis"
    assert not [d for d in single if d["kind"] == "PodDisruptionBudget"]
    assert not [d for d in render() if d["kind"] == "HorizontalPodAutoscaler"]
    assert "above maxReplicas" in _refused(
        "gateway.autoscaling.enabled=true", "gateway.autoscaling.minReplicas=5", "gateway.autoscaling.maxReplicas=2"
    )


def _render_file(values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    assert HELM is not None
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    out = subprocess.run(
        [HELM, "template", "rel", str(CHART), "-f", str(tmp_path / "values.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_ingress_and_http_route_reach_the_public_port_only(tmp_path: Path) -> None:
    docs = _render_file(
        {
            "gateway": {"adminPort": 9090},
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
                "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]}],
                "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
            },
            "httpRoute": {
                "enabled": True,
                "parentRefs": [{"name": "public", "namespace": "gateway-infra"}],
                "hostnames": ["llm.example.com"],
                "timeouts": {"request": "0s"},
            },
        },
        tmp_path,
    )
    svc = one(docs, "Service", f"{FULL}-gateway")
    http_port = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["http"]
    ing = one(docs, "Ingress", f"{FULL}-gateway")
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]
    [rule] = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"] == [
        {"path": "/v1", "pathType": "Prefix", "backend": {"service": {"name": svc["metadata"]["name"], "port": {"name": "http"}}}}
    ]
    route = one(docs, "HTTPRoute", f"{FULL}-gateway")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateway-infra"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    [route_rule] = route["spec"]["rules"]
    assert route_rule["backendRefs"] == [{"name": svc["metadata"]["name"], "port": http_port}]
    assert route_rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert route_rule["timeouts"] == {"request": "0s"}
    assert not [d for d in render() if d["kind"] in ("Ingress", "HTTPRoute")]
    # the schema refuses a route that attaches to nothing and an Ingress with no rule
    assert "parentRefs" in _refused("httpRoute.enabled=true")
    assert "hosts" in _refused("ingress.enabled=true", "ingress.hosts=null")
