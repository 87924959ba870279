"""/metrics tells what happened: requests, decisions, latency, load, and the predictors' errors."""

from __future__ import annotations

import httpx

from policies.registry import load_policy
from tests.support.cluster import cluster


def test_metrics_after_traffic() -> None:
    with cluster(
        "nixl", n_prefill=2, n_decode=2, policy=load_policy("kvcache_aware"), standin={"decode": {"token_delay_s": 0.002}}
    ) as c:
        for i in range(6):
            r = httpx.post(
                c.url + "/v1/completions",
                timeout=20,
                json={"model": "tiny", "prompt": "hello " * (i + 1), "max_tokens": 8, "stream": True},
            )
            assert r.status_code == 200
        text = httpx.get(c.url + "/metrics").text
        assert 'conductor_requests_total{route="/v1/completions",status="200"} 6.0' in text
        decisions = [line for line in text.splitlines() if line.startswith("conductor_decisions_total{")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in decisions) == 6
        assert all('policy="kvcache_aware"' in line for line in decisions)
        assert "conductor_ttft_seconds_count 6.0" in text
        assert "conductor_tbt_seconds_count 6.0" in text
        assert 'conductor_instance_healthy{instance="prefill-1",role="prefill"} 1.0' in text
        assert 'conductor_instance_running_decodes{instance="decode-0"} 0.0' in text  # all finished
        # the fitted predictors' error, per component and instance
        ttft = [line for line in text.splitlines() if line.startswith('conductor_prediction_mape{component="ttft"')]
        assert ttft, "TTFT prediction error not exported"
        samples = [line for line in text.splitlines() if line.startswith('conductor_prediction_samples{component="ttft"')]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in samples) == 6


def test_error_series_exist_before_the_first_error() -> None:
    with cluster("nixl") as c:
        text = httpx.get(c.url + "/metrics").text
    for instance in ("prefill-0", "decode-0"):
        for kind in ("status", "transport"):
            assert f'conductor_upstream_errors_total{{instance="{instance}",kind="{kind}"}} 0.0' in text
        assert f'conductor_instance_ejections_total{{instance="{instance}"}} 0.0' in text
