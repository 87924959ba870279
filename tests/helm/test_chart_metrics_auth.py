"""The chart's Prometheus scrape with client keys: without an admin port the gateway's /metrics on the
public port takes a key, which the scrape the chart sets up (pod annotations, a ServiceMonitor on port
http) does not send, so the chart leaves /metrics open there (auth.public_metrics) and nothing else;
with an admin port, or no scrape, it does not. Checked with the gateway's own loader and a gateway
serving the rendered auth settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conductor.config.settings import load_settings
from tests.helm.chart import gateway_config, needs_helm, render
from tests.support.cluster import cluster

pytestmark = needs_helm

KEYS = "gateway.apiKeys={sk-1}"


def _auth(tmp_path: Path, *sets: str) -> Any:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(gateway_config(render(*sets))))
    return load_settings(tmp_path / "config.yaml", environ={"CONDUCTOR_AUTH__API_KEYS": '["sk-1"]'}).auth


@pytest.mark.parametrize(
    ("sets", "public"),
    [
        ((KEYS,), True),  # the default scrape: pod annotations on the public port
        ((KEYS, "monitoring.podAnnotations=false", "monitoring.serviceMonitor.enabled=true"), True),
        ((KEYS, "gateway.adminPort=9090"), False),  # scraped on the admin port, which takes no key
        ((KEYS, "monitoring.podAnnotations=false"), False),  # nothing scrapes
        ((), False),  # no keys: /metrics is open anyway
        ((KEYS, "gateway.config.auth.public_metrics=false"), False),  # the operator's word wins
    ],
)
def test_metrics_stay_open_only_for_the_scrape_the_chart_sets_up(tmp_path: Path, sets: tuple[str, ...], public: bool) -> None:
    assert _auth(tmp_path, *sets).public_metrics is public


def test_the_rendered_auth_lets_the_scrape_in_and_keeps_the_docs_closed(tmp_path: Path) -> None:
    auth = gateway_config(render(KEYS))["auth"]
    with cluster("nixl", models=["tiny"], auth={**auth, "api_keys": ["sk-1"]}) as c:
        metrics = httpx.get(c.url + "/metrics", timeout=30)
        assert metrics.status_code == 200 and "conductor_instance_healthy" in metrics.text
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(c.url + path, timeout=30).status_code == 401, path
