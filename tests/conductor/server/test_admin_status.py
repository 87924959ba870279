"""GET /admin/status: the fleet, the last decisions and the last minutes' counts, with the admin key
(conductor/server/status_route.py, conductor/ops/status.py); `conductor status` prints it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from conductor.core.types import ClusterSnapshot, Decision, Observation, Rejection, RequestView, Slo
from conductor.kv.agreement import HashAgreement
from conductor.ops.status import DecisionRing, WindowedCounts
from conductor.server.app import create_admin_app, create_app
from conductor.status_cli import status_main
from policies.base import BasePolicy
from tests.support.cluster import cluster
from tests.support.servers import free_port, serve
from tests.support.waiting import wait_for

ADMIN_KEY = "adm-status"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}


class _RejectAll(BasePolicy):
    name = "reject_all"

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        return Decision(request.request_id, self.name, rejection=Rejection("ttft_slo", "predicted TTFT over the SLO", 3.2, 1.0))


def _status(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/admin/status", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def test_status_needs_the_admin_key_and_lists_the_fleet() -> None:
    slo = {"ttft_s": 60.0, "tbt_s": 10.0}  # bounds a hang alone misses: the request meets them
    with cluster("nixl", n_prefill=2, n_decode=1, models=["tiny"], auth={"admin_api_keys": [ADMIN_KEY]}, slo=slo) as c:
        assert httpx.get(c.url + "/admin/status").status_code == 401
        bad = httpx.get(c.url + "/admin/status", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        status = _status(c.url)
        assert {i["name"]: i["role"] for i in status["instances"]} == {
            "prefill-0": "prefill",
            "prefill-1": "prefill",
            "decode-0": "decode",
        }
        assert all(i["state"] == "healthy" and not i["ejected"] and not i["panic"] for i in status["instances"])
        # streamed: a TTFT the client saw, what the SLO is measured on
        assert httpx.post(c.url + "/v1/completions", json={**BODY, "stream": True}).status_code == 200
        assert wait_for(lambda: _status(c.url)["window"]["outcomes"]["ttft_met"] == 1)
        assert _status(c.url)["window"]["ttft_attainment"] == 1.0
        status = _status(c.url)
        [decision] = status["decisions"]
        assert decision["prefill"] in ("prefill-0", "prefill-1") and decision["decode"] == "decode-0"
        assert decision["prompt_tokens"] > 0 and "hello" not in str(decision)  # sizes, never the prompt's text
        assert status["window"]["decisions"] == 1 and status["window"]["rejections"] == {}


def test_status_without_an_admin_key_configured_is_disabled() -> None:
    with cluster("nixl", models=["tiny"]) as c:
        assert httpx.get(c.url + "/admin/status").status_code == 403
        page = httpx.get(c.url + "/status")  # the page holds no data: it is served, its poll is refused
        assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]


def test_the_window_counts_a_429_by_reason() -> None:
    with cluster("nixl", policy=_RejectAll(), models=["tiny"], auth={"admin_api_keys": [ADMIN_KEY]}) as c:
        for _ in range(2):
            assert httpx.post(c.url + "/v1/completions", json=BODY).status_code == 429
        status = _status(c.url)
    assert status["window"]["rejections"] == {"ttft_slo": 2}
    assert status["window"]["decisions"] == 2
    assert [d["rejection"]["reason"] for d in status["decisions"]] == ["ttft_slo", "ttft_slo"]
    assert status["decisions"][0]["seq"] > status["decisions"][1]["seq"]  # newest first


def test_status_on_the_admin_port_and_not_on_the_public_one(capsys: pytest.CaptureFixture[str]) -> None:
    settings = {"models": ["tiny"], "auth": {"admin_api_keys": [ADMIN_KEY]}, "admin_port": free_port()}
    with cluster("nixl", **settings) as c, serve(create_admin_app(c.gateway, create_app(c.gateway))) as admin:
        assert httpx.get(c.url + "/admin/status", headers=AUTH).status_code == 404
        assert httpx.get(c.url + "/status").status_code == 404
        assert httpx.post(c.url + "/v1/completions", json=BODY).status_code == 200
        assert _status(admin.url)["window"]["decisions"] == 1
        assert status_main(["--url", admin.url, "--admin-key", ADMIN_KEY]) == 0
        table = capsys.readouterr().out
        assert "prefill-0" in table and "decode-0" in table and "1 decisions" in table
        assert status_main(["--url", admin.url, "--admin-key", "nope"]) == 1
        assert "401" in capsys.readouterr().err


def _decision(n: int, reason: str | None = None) -> Decision:
    rejection = None if reason is None else Rejection(reason, "no")
    return Decision(f"req-{n}", "p", prefill=None if reason else "a", rejection=rejection)


def test_the_decision_ring_is_bounded() -> None:
    ring = DecisionRing(capacity=3)
    for n in range(10):
        ring.add(_decision(n), prompt_tokens=n)
    records = ring.records()
    assert [r["request_id"] for r in records] == ["req-9", "req-8", "req-7"]
    assert [r["seq"] for r in records] == [10, 9, 8]


def test_the_window_forgets_what_is_older_than_it() -> None:
    now = [1000.0]
    window = WindowedCounts(window_s=60.0, bucket_s=10.0, clock=lambda: now[0])
    window.decided(_decision(0, "ttft_slo"))
    ok = Observation("r", "a", "b", 10, None, 0, None, ttft_s=0.2, token_intervals_s=(0.01, 0.03))
    window.observed(ok, Slo(ttft_s=0.5, tbt_s=0.01))
    summary = window.summary()
    assert summary["rejections"] == {"ttft_slo": 1}
    assert summary["outcomes"]["ttft_met"] == 1 and summary["outcomes"]["tbt_missed"] == 1  # a mean gap of 20 ms
    assert summary["ttft_attainment"] == 1.0 and summary["tbt_attainment"] == 0.0
    for _ in range(200):  # many buckets later: a bounded window, nothing of the old one left
        now[0] += 10.0
        window.decided(_decision(1))
    summary = window.summary()
    assert summary["rejections"] == {} and summary["decisions"] == 6 and summary["ttft_attainment"] is None


def test_an_instances_kv_agreement_as_the_page_shows_it() -> None:
    agreement = HashAgreement(CollectorRegistry(), window=10, min_samples=2, alarm_below=0.5)
    assert agreement.instance_figures("prefill-0") is None  # nothing finished there yet
    for _ in range(3):  # the index predicted 100 cached tokens, the worker found none: the keys disagree
        agreement.observe(100, 0, instance="prefill-0")
    figures = agreement.instance_figures("prefill-0")
    assert figures is not None and figures["samples"] == 3 and figures["agreement"] == 0.0
    assert "over" in figures["alarms"] and isinstance(figures["alarms"]["over"], str)
