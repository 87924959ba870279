"""The decision log the gateway writes is the record `conductor.core.decision_log` defines:
one JSON line per decision, admitted or rejected, with per-candidate predictions and no prompt text."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from conductor.core.decision_log import decision_log_record
from conductor.core.types import ClusterSnapshot, Decision, RequestView, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from tests.support.cluster import cluster

PROMPT = "the secret prompt text " * 8


class _Keeping(KvCacheAwarePolicy):
    """Conductor's own policy, keeping every decision it was told it made."""

    def __init__(self) -> None:
        super().__init__(admission="predicted")
        self.made: list[tuple[RequestView, Decision]] = []

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        super().on_decided(request, cluster, decision)
        self.made.append((request, decision))


def _logged(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "conductor.decisions"]


def test_gateway_logs_the_tested_record_for_admitted_and_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conductor.decisions")
    policy = _Keeping()
    with cluster("nixl", policy=policy, n_prefill=2) as c:
        ok = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
        assert ok.status_code == 200
        rejected = httpx.post(
            c.url + "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4},
            headers={"x-slo-ttft-ms": "0.001"},
        )
        assert rejected.status_code == 429
    logged = _logged(caplog)
    assert len(logged) == 2 == len(policy.made)
    for line, (view, decision) in zip(logged, policy.made, strict=True):
        assert line == json.loads(json.dumps(decision_log_record(decision, view.prompt_tokens, view.model)))
        assert line["prompt_tokens"] == view.prompt_tokens and line["model"] == "tiny"
        assert "secret" not in json.dumps(line)
    admitted, refused = logged
    assert admitted["rejected"] is False and admitted["prefill"] in ("prefill-0", "prefill-1")
    cands = admitted["candidates"]
    assert isinstance(cands, list) and {c["instance"] for c in cands} >= {"prefill-0", "prefill-1", "decode-0"}
    assert all("predicted_ttft_s" in c for c in cands if c["role"] == "prefill")
    assert refused["rejected"] is True
    assert isinstance(refused["rejection"], dict) and refused["rejection"]["reason"] == "ttft_slo"


def test_record_of_a_rejection_carries_the_bound() -> None:
    from policies.kvcache_aware import KvCacheAwarePolicy as Policy
    from tests.policies.cluster_builders import decode, prefill, request, snapshot

    d = Policy().decide(request(slo=Slo(ttft_s=0.01)), snapshot(prefill("p0"), decode("d0")))
    rec = decision_log_record(d, 8192)
    assert rec["rejected"] is True and rec["prompt_tokens"] == 8192
    assert rec["rejection"]["slo_s"] == 0.01 and rec["rejection"]["predicted_s"] > 0.01
