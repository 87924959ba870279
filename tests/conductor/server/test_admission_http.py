"""Admission through the HTTP path: SLOs from settings and per-request headers reach the policy;
Conductor's own policy answers 429 before any worker sees the request."""

from __future__ import annotations

import httpx

from conductor.core.types import ClusterSnapshot, Decision, RequestView, Role
from policies.base import BasePolicy
from policies.registry import load_policy
from tests.support.cluster import cluster


class _Recording(BasePolicy):
    name = "recording"

    def __init__(self) -> None:
        self.seen: list[RequestView] = []

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.seen.append(request)
        p = cluster.by_role(Role.PREFILL)[0].id
        d = cluster.by_role(Role.DECODE)[0].id
        return Decision(request.request_id, self.name, prefill=p, decode=d)


def test_slo_defaults_and_per_request_headers() -> None:
    policy = _Recording()
    with cluster("nixl", policy=policy, slo={"ttft_s": 2.0, "tbt_s": 0.1}, default_max_tokens=77) as c:
        httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "abcdefgh" * 4})
        httpx.post(
            c.url + "/v1/completions",
            json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 9},
            headers={"x-slo-ttft-ms": "500", "x-slo-tbt-ms": "40"},
        )
        first, second = policy.seen
        assert (first.slo.ttft_s, first.slo.tbt_s) == (2.0, 0.1)
        assert (second.slo.ttft_s, second.slo.tbt_s) == (0.5, 0.04)
        assert first.max_tokens == 77 and second.max_tokens == 9
        assert second.prompt_tokens == 3  # token ids are counted exactly
        assert second.seq == first.seq + 1
        bad = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"x-slo-ttft-ms": "soon"})
        assert bad.status_code == 400


def test_kvcache_aware_rejects_with_429_before_forwarding() -> None:
    with cluster("nixl", policy=load_policy("kvcache_aware"), slo={"ttft_s": 0.0001}) as c:
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 4000, "max_tokens": 4})
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "ttft_slo"
        assert "TTFT" in err["message"] and "SLO" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert not c.prefills[0].requests and not c.decodes[0].requests
        # a generous per-request SLO is admitted
        ok = httpx.post(
            c.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4}, headers={"x-slo-ttft-ms": "60000"}
        )
        assert ok.status_code == 200, ok.text
