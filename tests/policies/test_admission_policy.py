"""SLO admission: reasons, amounts, Retry-After, and prediction-based vs plain early rejection."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.core.errors import ConfigError
from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Role, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.simple import LeastLoadedPolicy
from predictors import OnlineConfig, PredictorParams, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import decode, prefill, request, snapshot


@pytest.fixture(scope="module")
def params() -> PredictorParams:
    return fit_profiles([bundled_profile()])


def policy(params: PredictorParams, admission: str = "predicted", **kw: Any) -> KvCacheAwarePolicy:
    pred = Predictors(params, OnlineConfig(enabled=False))
    return KvCacheAwarePolicy(admission=admission, predictors=pred, **kw)


def test_ttft_rejection_says_by_how_much_and_when_to_retry(params: PredictorParams) -> None:
    cluster = snapshot(prefill("p0", queued=30), prefill("p1", queued=25), decode("d0"))
    pol = policy(params)
    d = pol.decide(request(slo=Slo(ttft_s=1.0)), cluster)
    r = d.rejection
    assert r is not None and r.reason == "ttft_slo"
    assert d.prefill is None and d.decode is None
    assert r.slo_s == 1.0 and r.predicted_s == d.predicted_ttft_s and r.predicted_s is not None
    # judged by the calibrated upper bound (before any observation: the prefill fit's p90 ratio)
    bound = pol.predictors.bound("ttft", r.predicted_s, 0.95)
    assert bound == pytest.approx(r.predicted_s * params.prefill.p90_ratio)
    excess = bound - 1.0
    assert excess > 2.0
    assert r.retry_after_s == pytest.approx(excess)  # the queue must drain by the excess
    assert "TTFT SLO 1.000s" in r.message and f"by {excess:.3f}s" in r.message and "p1" in r.message
    assert r.retryable  # once the queue drains it fits: a retry can help


def test_ttft_admission_judges_the_calibrated_upper_quantile(params: PredictorParams) -> None:
    """A request predicted at 0.9 of the SLO is admitted on the point prediction, but when recent
    requests ran 20-30% over their predictions the 95% bound is over the SLO: rejected."""
    cluster = snapshot(prefill("p0", queued=3), decode("d0"))
    probe = policy(params, ttft_quantile=None).decide(request(), cluster)
    assert probe.predicted_ttft_s is not None
    slo = Slo(ttft_s=probe.predicted_ttft_s / 0.9)
    point = policy(params, ttft_quantile=None)
    calibrated = policy(params)
    for i in range(40):
        calibrated.predictors.ratios.add("ttft", 1.0, 1.2 + 0.1 * (i % 2))
    assert point.decide(request(slo=slo), cluster).rejection is None
    r = calibrated.decide(request(slo=slo), cluster).rejection
    assert r is not None and r.reason == "ttft_slo" and "upper bound" in r.message
    # and requests that ran under their predictions loosen it
    lenient = policy(params)
    for _ in range(40):
        lenient.predictors.ratios.add("ttft", 1.0, 0.95)
    assert lenient.decide(request(slo=slo), cluster).rejection is None


def test_ttft_slo_no_idle_instance_can_meet(params: PredictorParams) -> None:
    d = policy(params).decide(request(slo=Slo(ttft_s=0.05)), snapshot(prefill("p0"), decode("d0")))
    assert d.rejection is not None and d.rejection.reason == "ttft_slo"
    assert "own prefill" in d.rejection.message and d.rejection.retry_after_s == 1.0
    assert d.rejection.retryable is False  # sent again it would be refused again (x-should-retry: false)


def test_tbt_rejection(params: PredictorParams) -> None:
    heavy = decode("d0", streams=300, context=6000, remaining=4000)
    for mode in ("early", "predicted"):
        d = policy(params, mode).decide(request(slo=Slo(ttft_s=5.0, tbt_s=0.05)), snapshot(prefill("p0"), heavy))
        r = d.rejection
        assert r is not None and r.reason == "tbt_slo", mode
        assert r.predicted_s is not None and r.predicted_s > 0.05 and r.slo_s == 0.05
        assert "TBT SLO 50.00ms" in r.message and "d0" in r.message
        assert 1.0 < r.retry_after_s <= 60.0
        assert r.retryable  # streams end: the gateway may hold it for that (conductor/routing/waiting_room.py)


def test_a_tbt_slo_an_idle_decode_misses_is_not_retryable(params: PredictorParams) -> None:
    # 1 ms a token: no step of the model is that fast, whatever the batch; waiting cannot cure it
    d = policy(params).decide(request(slo=Slo(ttft_s=5.0, tbt_s=0.001)), snapshot(prefill("p0"), decode("d0", streams=4)))
    r = d.rejection
    assert r is not None and r.reason == "tbt_slo"
    assert r.retryable is False


def test_prediction_based_admits_what_plain_early_rejection_refuses(params: PredictorParams) -> None:
    # decode is overloaded now (~114 ms a step), but every stream has 1 token left: gone before this request's
    # ~0.2 s prefill is done. Plain early rejection (load now) refuses; prediction-based admits.
    draining = decode("d0", streams=300, context=6000, remaining=1)
    cluster = snapshot(prefill("p0"), draining)
    req = request(slo=Slo(ttft_s=2.0, tbt_s=0.04))
    early = policy(params, "early").decide(req, cluster)
    assert early.rejection is not None and early.rejection.reason == "tbt_slo"
    predicted = policy(params, "predicted").decide(req, cluster)
    assert not predicted.rejected and predicted.decode == "d0"
    assert predicted.predicted_tbt_s is not None and predicted.predicted_tbt_s < 0.04
    only_this = Predictors(params).tbt_s(1, 8192)  # every other stream gone when it arrives
    assert predicted.predicted_tbt_s == pytest.approx(only_this)
    chosen = predicted.candidates[-1].detail  # the log shows both views of d0
    assert chosen["batch"] == 301 and chosen["admission_batch"] == 1 and chosen["admission_at_s"] > 0
    none = policy(params, "none").decide(req, cluster)
    assert not none.rejected


def test_prediction_counts_prefills_that_will_have_joined(params: PredictorParams) -> None:
    # for views that do not list dispatched requests under their decode instance already:
    # p1 finishes 40 short prefills before this request's long one, so they reach decode first
    shorts = tuple(QueuedPrefill(256, 0, 0.0) for _ in range(40))
    busy_p1 = prefill("p1")
    busy_p1 = type(busy_p1)(busy_p1.id, busy_p1.role, prefill_queue=shorts)
    cluster = snapshot(prefill("p0"), busy_p1, decode("d0"), decode("d1"))
    d = policy(params, "predicted", forecast_joins=True).decide(request(prompt=32000), cluster)
    alone = Predictors(params).tbt_s(1, 32000)
    assert d.predicted_tbt_s is not None and d.predicted_tbt_s > alone  # a share of the joined prefills
    # by default the queued prefills are taken to be in the decode view already: not counted again
    plain = policy(params, "predicted").decide(request(prompt=32000), cluster)
    assert plain.predicted_tbt_s == pytest.approx(alone)


def test_early_leaves_out_streams_still_in_prefill(params: PredictorParams) -> None:
    # 300 requests routed to d0 but still prefilling: not decoding load *now*, but they will be
    incoming = tuple(ActiveDecode(6000, 500, decoding=False) for _ in range(300))
    cluster = snapshot(prefill("p0"), InstanceView("d0", Role.DECODE, decodes=incoming))
    req = request(slo=Slo(ttft_s=2.0, tbt_s=0.04))
    assert not policy(params, "early").decide(req, cluster).rejected  # the lag of plain early rejection
    d = policy(params, "predicted").decide(req, cluster)
    assert d.rejection is not None and d.rejection.reason == "tbt_slo"


def test_baselines_admit_everything_unless_asked(params: PredictorParams) -> None:
    heavy = decode("d0", streams=300, context=6000, remaining=4000)
    req = request(slo=Slo(ttft_s=5.0, tbt_s=0.05))
    assert not LeastLoadedPolicy().decide(req, snapshot(prefill("p0"), heavy)).rejected
    d = LeastLoadedPolicy(admission="early").decide(req, snapshot(prefill("p0"), heavy))
    assert d.rejection is not None and d.rejection.reason == "tbt_slo"


def test_bad_admission_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="'admission' must be one of none, early, predicted"):
        KvCacheAwarePolicy(admission="sometimes")


def test_a_shifted_ttft_bound_keeps_a_fixed_delay_additive(params: PredictorParams) -> None:
    """Recent short requests each ran 0.3 s late (a prefill queued ahead unseen). With the plain
    ratio a request predicted well under its SLO is refused (its bound: 4x the prediction); with
    `ttft_bound_shift_s` of the order of the SLO its bound is near prediction + delay: admitted."""
    cluster = snapshot(prefill("p0", queued=3), decode("d0"))
    probe = policy(params, ttft_quantile=None).decide(request(), cluster)
    p = probe.predicted_ttft_s
    assert p is not None
    c = p + 0.6  # the SLO, and the shift
    slo = Slo(ttft_s=c)
    plain = policy(params)
    shifted = KvCacheAwarePolicy(admission="predicted", online=False, ttft_bound_shift_s=c)
    for pol in (plain, shifted):
        for _ in range(40):
            pol.predictors.ratios.add("ttft", 0.1, 0.4)
    assert plain.decide(request(slo=slo), cluster).rejection is not None
    d = shifted.decide(request(slo=slo), cluster)
    assert d.rejection is None and d.prefill == "p0"
    bound = shifted.predictors.bound("ttft", p, 0.95)
    assert bound == pytest.approx((p + c) * (0.4 + c) / (0.1 + c) - c)
    assert p + 0.3 < bound < p + 0.6
