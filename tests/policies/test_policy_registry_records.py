"""Every built-in is registered and loads with no options; decisions log as plain JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conductor.core.decision_log import decision_log_record
from conductor.core.errors import PluginError
from conductor.core.types import InstanceView, Role, Slo
from policies import RECOMMENDED_POLICY
from policies.registry import available_policies, load_policy
from tests.policies.cluster_builders import decode, prefill, request, snapshot

BUILT_INS = (
    "round_robin",
    "random",
    "least_loaded",
    "sglang_cache_aware",
    "dynamo_kv",
    "llmd",
    "kvcache_aware",
)


def test_all_built_ins_registered() -> None:
    assert set(BUILT_INS) <= set(available_policies())
    assert RECOMMENDED_POLICY == "kvcache_aware"


@pytest.mark.parametrize("name", BUILT_INS)
def test_built_in_loads_and_routes(name: str) -> None:
    pol = load_policy(name)
    assert pol.name == name
    cluster = snapshot(prefill("p0"), prefill("p1", queued=2), decode("d0"), decode("d1", streams=3))
    d = pol.decide(request(cached={"p1": 4096}), cluster)
    assert d.policy == name and d.prefill in {"p0", "p1"} and d.decode in {"d0", "d1"}
    mixed = snapshot(InstanceView("m0", Role.MIXED), InstanceView("m1", Role.MIXED))
    d = pol.decide(request(), mixed)
    assert d.prefill in {"m0", "m1"} and d.decode is None
    json.dumps(decision_log_record(d))


def test_kvcache_aware_options_from_config() -> None:
    pol = load_policy("kvcache_aware", {"admission": "early", "online": False, "allow_pull": False})
    assert getattr(pol, "admission", None) == "early"


def test_decision_log_record_is_plain_json_without_prompt_text() -> None:
    pol = load_policy("kvcache_aware")
    cluster = snapshot(prefill("p0", queued=4), prefill("p1"), decode("d0"))
    d = pol.decide(request(cached={"p0": 6144}), cluster)
    rec = json.loads(json.dumps(decision_log_record(d)))
    assert rec["prefill"] == "p1" and rec["pull_from"] == "p0" and rec["pull_tokens"] == 6144
    assert rec["rejected"] is False and "rejection" not in rec
    by_id = {c["instance"]: c for c in rec["candidates"]}
    assert set(by_id) == {"p0", "p1", "d0"}
    assert {"transfer_s", "queue_s", "prefill_s", "cached_tokens", "pulled_tokens"} <= set(by_id["p1"])
    # the candidate's figure ends at the KV handoff; the decision's adds the learned decode leg
    assert 0 < by_id["p1"]["predicted_ttft_s"] < rec["predicted_ttft_s"] < by_id["p1"]["predicted_ttft_s"] + 0.1
    rejected = pol.decide(request(slo=Slo(ttft_s=0.01)), cluster)
    rrec = decision_log_record(rejected)
    assert rrec["rejected"] is True and rrec["rejection"]["reason"] == "ttft_slo"
    assert rrec["rejection"]["slo_s"] == 0.01 and rrec["prefill"] is None


def test_kvcache_aware_loads_fitted_params_file(tmp_path: Path) -> None:
    from predictors import PredictorParams, bundled_profile, fit_profiles

    path = tmp_path / "params.json"
    fit_profiles([bundled_profile()]).scaled(prefill=3.0).save(path)
    from policies.kvcache_aware import KvCacheAwarePolicy

    pol = load_policy("kvcache_aware", {"predictor_params": str(path)})
    assert isinstance(pol, KvCacheAwarePolicy)
    pred = pol.predictors
    assert pred.params.prefill.coef == pytest.approx(PredictorParams.load(path).prefill.coef)
    with pytest.raises(PluginError, match=r"failed to construct.*missing\.json"):
        load_policy("kvcache_aware", {"predictor_params": str(tmp_path / "missing.json")})
