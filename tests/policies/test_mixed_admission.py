"""kvcache_aware on mixed workers: placement judged as admission judges it, and TBT admission that
neither turns away requests likely to meet their SLO nor stays stuck rejecting everything."""

from __future__ import annotations

import pytest
from cluster_builders import request, snapshot

from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Role, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from predictors import OnlineConfig, Predictors, bundled_profile, fit_profiles


def streams(n: int, context: int = 8000) -> tuple[ActiveDecode, ...]:
    return tuple(ActiveDecode(context, 200) for _ in range(n))


def mixed(iid: str, n_streams: int = 0) -> InstanceView:
    return InstanceView(iid, Role.MIXED, decodes=streams(n_streams))


def predictors(ratios: list[float] | None = None) -> Predictors:
    """Fixed models (the bundled profile) and, when given, these actual/predicted ratios of the TBT
    admission judges: what a gateway learned about how far its mixed TBT predictions miss."""
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(enabled=False))
    for r in ratios or ():
        pred.ratios.add("tbt_judged", 0.01, 0.01 * r)
    return pred


WIDE = [1.0] * 20 + [3.0] * 20  # a mixed worker's spread: the median ratio 2.0, the 0.9 quantile 3.0


def test_placement_uses_the_bound_admission_judges() -> None:
    pred = predictors(WIDE)
    busy, light = mixed("m0", 60), mixed("m1", 1)
    tbt_busy, tbt_light = pred.tbt_s(61, 8192 + 60 * 8000), pred.tbt_s(2, 8192 + 8000)
    slo = 1.5 * tbt_busy  # m0's point prediction fits, its bound (x2.0) does not; m1's bound fits
    assert tbt_busy < slo < 2.0 * tbt_busy and 2.0 * tbt_light < slo
    # m0 holds the prefix: the lower TTFT; judged by the point prediction it was chosen, then rejected
    d = KvCacheAwarePolicy(predictors=pred).decide(
        request(8192, cached={"m0": 8000}, slo=Slo(ttft_s=5.0, tbt_s=slo)), snapshot(busy, light))
    assert (d.prefill, d.decode, d.rejected) == ("m1", None, False)


def test_equal_ttfts_go_to_the_lighter_batch() -> None:
    # no queues, nothing cached: every TTFT equal; the pool's order used to decide
    d = KvCacheAwarePolicy(predictors=predictors()).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.1)), snapshot(mixed("m0", 40), mixed("m1", 3), mixed("m2", 10)))
    assert d.prefill == "m1" and not d.rejected


def test_an_idle_worker_is_not_judged_on_tbt() -> None:
    # a TBT model that says no worker meets the SLO, even for a batch of one (fitted under a backlog)
    pred = predictors()
    slo = 0.5 * pred.tbt_s(1, 4096)
    busy_only = KvCacheAwarePolicy(predictors=pred).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=slo)), snapshot(mixed("m0", 1)))
    assert busy_only.rejected and busy_only.rejection is not None and busy_only.rejection.reason == "tbt_slo"
    d = KvCacheAwarePolicy(predictors=pred).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=slo)), snapshot(mixed("m0", 1), mixed("m1")))
    assert (d.prefill, d.rejected) == ("m1", False)  # the idle one, admitted: what it sees teaches the model


def test_a_queued_prefill_makes_a_worker_busy() -> None:
    pred = predictors()
    queued = InstanceView("m0", Role.MIXED, prefill_queue=(QueuedPrefill(2000, 0, 0.0),))
    d = KvCacheAwarePolicy(predictors=pred).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.5 * pred.tbt_s(1, 4096))), snapshot(queued))
    assert d.rejected  # a prefill waits there: not idle, judged as any other worker


@pytest.mark.parametrize(("quantile", "admitted"), [(None, True), (0.5, True), (0.9, False)])
def test_mixed_tbt_quantile(quantile: float | None, admitted: bool) -> None:
    pred = predictors(WIDE)
    tbt = pred.tbt_s(2, 4096 + 8000)
    slo = 2.5 * tbt  # met by the median ratio (2.0), not by the 0.9 quantile (3.0)
    policy = KvCacheAwarePolicy(predictors=pred, mixed_tbt_quantile=quantile)
    d = policy.decide(request(4096, slo=Slo(ttft_s=5.0, tbt_s=slo)), snapshot(mixed("m0", 1)))
    assert d.rejected is not admitted
    # P/D keeps its own quantile: the decode of a disaggregated request is judged at tbt_quantile
    assert policy.tbt_quantile == 0.9


def test_before_enough_ratios_the_median_bound_is_the_point_prediction() -> None:
    # a fresh window (or one a refit just emptied): the 0.9 tail falls back on the fit's in-sample
    # p90 ratio, the median on the point prediction, not on that p90 ratio
    pred = predictors()
    assert pred.params.tbt.p90_ratio > 1.05
    tbt = pred.tbt_s(2, 4096 + 8000)
    slo = Slo(ttft_s=5.0, tbt_s=1.05 * tbt)
    assert not KvCacheAwarePolicy(predictors=pred).decide(request(4096, slo=slo), snapshot(mixed("m0", 1))).rejected
    strict = KvCacheAwarePolicy(predictors=pred, mixed_tbt_quantile=0.9)
    assert strict.decide(request(4096, slo=slo), snapshot(mixed("m0", 1))).rejected
