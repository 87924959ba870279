"""kvcache_aware's local prefills (policies/local_prefill.py): when a decode computes a prompt itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conductor.core.types import ActiveDecode, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.local_prefill import LocalPrefill
from predictors import OnlineConfig, PredictorParams, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import decode, prefill, request, routed, snapshot


@pytest.fixture(scope="module")
def params() -> PredictorParams:
    return fit_profiles([bundled_profile()])


def policy(params: PredictorParams, **kw: object) -> KvCacheAwarePolicy:
    return KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig(enabled=False)), **kw)  # type: ignore[arg-type]


BACKED_UP = (prefill("p0", queued=40), prefill("p1", queued=40))  # seconds of prefill queued on each


def test_a_short_prompt_goes_to_the_least_loaded_decode_when_the_prefills_are_backed_up(params: PredictorParams) -> None:
    cluster = snapshot(*BACKED_UP, decode("d0", streams=30), decode("d1", streams=2))
    pol = policy(params, local_prefill_tokens=4096)
    d = routed(pol, request(prompt=2048), cluster)
    assert (d.prefill, d.decode, d.pull_from) == ("d1", "d1", None)
    local = d.candidates[0]
    assert local.instance_id == "d1" and local.detail["transfer_s"] == 0.0 and local.detail["handoff_s"] == 0.0
    assert 0 < local.detail["local_prefill_duty"] <= 0.15
    # what the disaggregated placement weighed is logged after it, slower by more than 1/gain
    slowest_local = local.predicted_ttft_s
    assert slowest_local is not None and d.predicted_ttft_s == slowest_local
    disaggregated = [c for c in d.candidates[1:] if c.predicted_ttft_s is not None]
    assert disaggregated and all(0.8 * c.predicted_ttft_s > slowest_local for c in disaggregated)  # type: ignore[operator]
    # its TBT is the decode's stretched by the duty
    assert local.predicted_tbt_s is not None and d.predicted_tbt_s == local.predicted_tbt_s
    assert pol.learner.pending == {}  # a local leg is not learned from


def test_off_by_default_for_long_prompts_and_where_the_prefills_are_quick(params: PredictorParams) -> None:
    backed_up = snapshot(*BACKED_UP, decode("d0"))
    assert routed(policy(params), request(prompt=2048), backed_up).prefill in ("p0", "p1")
    assert routed(policy(params, local_prefill_tokens=4096), request(prompt=8192), backed_up).prefill in ("p0", "p1")
    idle = snapshot(prefill("p0"), decode("d0"))
    assert routed(policy(params, local_prefill_tokens=4096), request(prompt=2048), idle).prefill == "p0"


def test_not_where_the_prefill_pool_reuses_half_the_prompt(params: PredictorParams) -> None:
    cluster = snapshot(*BACKED_UP, decode("d0"))
    pol = policy(params, local_prefill_tokens=4096, allow_pull=False)
    assert routed(pol, request(prompt=4096, cached={"p0": 2048}), cluster).prefill == "p0"
    assert routed(pol, request(prompt=4096, cached={"p0": 1024}, rid="r2"), cluster).prefill == "d0"


def test_the_duty_cap_holds_over_its_window(params: PredictorParams) -> None:
    pol = policy(params, local_prefill_tokens=4096, local_prefill_duty=0.01)
    assert pol.local is not None
    one = pol.predictors.prefill_s(4096, 0)
    fit = int(0.01 * pol.local.window_s // one)  # local prefills one decode takes per window
    assert fit >= 1
    cluster = snapshot(*BACKED_UP, decode("d0"))
    where = [routed(pol, request(prompt=4096, rid=f"r{i}"), cluster).prefill for i in range(fit + 2)]
    assert where[:fit] == ["d0"] * fit and "d0" not in where[fit:]
    later = replace(cluster, now=cluster.now + pol.local.window_s + 1)  # the window has moved on
    assert routed(pol, request(prompt=4096, rid="later"), later).prefill == "d0"


def test_not_where_the_stretched_tbt_misses_the_slo(params: PredictorParams) -> None:
    cluster = snapshot(*BACKED_UP, decode("d0", streams=8))
    pol = policy(params, local_prefill_tokens=4096, admission="none")
    free = routed(pol, request(prompt=2048), cluster)
    assert free.prefill == "d0" and free.predicted_tbt_s is not None
    tight = Slo(tbt_s=free.predicted_tbt_s * 0.99)
    pol2 = policy(params, local_prefill_tokens=4096, admission="none")
    assert routed(pol2, request(prompt=2048, slo=tight), cluster).prefill in ("p0", "p1")


def test_not_where_a_stream_there_is_too_close_to_its_end_to_absorb_the_stall(params: PredictorParams) -> None:
    # the same load, TBT SLO twice the predicted TBT: a stream with 200 tokens to go spreads the
    # prefill's pause over them; one with 2 to go would see nearly all of it in its mean TBT
    roomy = snapshot(*BACKED_UP, decode("d0", streams=8))
    free = routed(policy(params, local_prefill_tokens=4096, admission="none"), request(prompt=2048), roomy)
    assert free.prefill == "d0" and free.predicted_tbt_s is not None
    slo = Slo(tbt_s=free.predicted_tbt_s * 2)
    pol = policy(params, local_prefill_tokens=4096, admission="none")
    assert routed(pol, request(prompt=2048, slo=slo), roomy).prefill == "d0"
    ending = snapshot(
        *BACKED_UP, replace(roomy.instances[-1], decodes=(*roomy.instances[-1].decodes[:-1], ActiveDecode(2000, 2)))
    )
    pol = policy(params, local_prefill_tokens=4096, admission="none")
    assert routed(pol, request(prompt=2048, slo=slo), ending).prefill in ("p0", "p1")


def test_a_rejected_request_is_saved_by_a_local_prefill(params: PredictorParams) -> None:
    cluster = snapshot(*BACKED_UP, decode("d0"))
    slo = Slo(ttft_s=1.0)
    assert routed(policy(params), request(prompt=2048, slo=slo), cluster).rejection is not None
    d = routed(policy(params, local_prefill_tokens=4096), request(prompt=2048, slo=slo), cluster)
    assert d.rejection is None and d.prefill == d.decode == "d0"
    assert d.predicted_ttft_s is not None and d.predicted_ttft_s <= 0.9


def test_settings_are_checked() -> None:
    for bad in (
        {"max_tokens": 0},
        {"max_tokens": 1, "max_duty": 1.0},
        {"max_tokens": 1, "gain": 0.0},
        {"max_tokens": 1, "window_s": 0.0},
    ):
        with pytest.raises(ValueError):
            LocalPrefill(**bad)  # type: ignore[arg-type]
