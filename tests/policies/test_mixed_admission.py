"""kvcache_aware on mixed workers: placement judged as admission judges it, and TBT admission that
neither turns away requests likely to meet their SLO nor stays stuck rejecting everything."""

from __future__ import annotations

import pytest

from conductor.core.errors import ConfigError
from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Role, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.kvcache_aware.mixed import observed_pace_s
from predictors import OnlineConfig, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import decode, prefill, request, snapshot


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
        request(8192, cached={"m0": 8000}, slo=Slo(ttft_s=5.0, tbt_s=slo)), snapshot(busy, light)
    )
    assert (d.prefill, d.decode, d.rejected) == ("m1", None, False)


def test_equal_ttfts_go_to_the_lighter_batch() -> None:
    # no queues, nothing cached: every TTFT equal; the pool's order used to decide
    d = KvCacheAwarePolicy(predictors=predictors()).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.1)), snapshot(mixed("m0", 40), mixed("m1", 3), mixed("m2", 10))
    )
    assert d.prefill == "m1" and not d.rejected


def test_an_idle_worker_is_not_judged_on_tbt() -> None:
    # a TBT model that says no worker meets the SLO, even for a batch of one (fitted under a backlog)
    pred = predictors()
    slo = 0.5 * pred.tbt_s(1, 4096)
    busy_only = KvCacheAwarePolicy(predictors=pred).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=slo)), snapshot(mixed("m0", 1))
    )
    assert busy_only.rejected and busy_only.rejection is not None and busy_only.rejection.reason == "tbt_slo"
    d = KvCacheAwarePolicy(predictors=pred).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=slo)), snapshot(mixed("m0", 1), mixed("m1"))
    )
    assert (d.prefill, d.rejected) == ("m1", False)  # the idle one, admitted: what it sees teaches the model


def test_a_queued_prefill_makes_a_worker_busy() -> None:
    pred = predictors()
    queued = InstanceView("m0", Role.MIXED, prefill_queue=(QueuedPrefill(2000, 0, 0.0),))
    d = KvCacheAwarePolicy(predictors=pred).decide(
        request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.5 * pred.tbt_s(1, 4096))), snapshot(queued)
    )
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
    assert policy.options.admission.tbt_quantile == 0.9


def test_before_enough_ratios_the_median_bound_is_the_point_prediction() -> None:
    # a fresh window (or one a refit just emptied): the 0.9 tail falls back on the fit's in-sample
    # p90 ratio, the median on the point prediction, not on that p90 ratio
    pred = predictors()
    assert pred.params.tbt.p90_ratio > 1.05
    tbt = pred.tbt_s(2, 4096 + 8000)
    slo = Slo(ttft_s=5.0, tbt_s=1.05 * tbt)
    # (the stream there has 5% of the SLO to spare: the stream check would turn the prefill away)
    median = KvCacheAwarePolicy(predictors=pred, mixed_protect_streams=False)
    assert not median.decide(request(4096, slo=slo), snapshot(mixed("m0", 1))).rejected
    strict = KvCacheAwarePolicy(predictors=pred, mixed_tbt_quantile=0.9, mixed_protect_streams=False)
    assert strict.decide(request(4096, slo=slo), snapshot(mixed("m0", 1))).rejected


# ---- placement: the fewest stream-seconds stalled (mixed_ttft_slack) ---------------------------


def queued(iid: str, n_streams: int, queued_tokens: int) -> InstanceView:
    return InstanceView(iid, Role.MIXED, decodes=streams(n_streams), prefill_queue=(QueuedPrefill(queued_tokens, 0, 0.0),))


def test_the_prefill_goes_where_it_pauses_fewest_streams() -> None:
    pred = predictors()
    crowded, calm = mixed("m0", 12), queued("m1", 1, 2000)  # m0: the lower TTFT (nothing queued), 12 streams
    req = request(4096, slo=Slo(ttft_s=5.0, tbt_s=1.0))
    by_ttft = KvCacheAwarePolicy(predictors=pred, mixed_ttft_slack=None).decide(req, snapshot(crowded, calm))
    assert by_ttft.prefill == "m0"
    d = KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(crowded, calm))
    assert (d.prefill, d.rejected) == ("m1", False)
    assert d.predicted_ttft_s is not None and by_ttft.predicted_ttft_s is not None
    assert d.predicted_ttft_s > by_ttft.predicted_ttft_s  # TTFT given up, within the slack, for the streams
    # the decision log shows what the placement ranked by: prefill seconds x (streams there + 1)
    stalled = {c.instance_id: c.detail["stalled_stream_s"] for c in d.candidates if c.predicted_ttft_s is not None}
    assert stalled["m1"] == pytest.approx(2 * pred.prefill_s(4096, 0)) and stalled["m0"] == pytest.approx(
        13 * pred.prefill_s(4096, 0)
    )


def test_a_prefix_holder_is_worth_its_streams() -> None:
    pred = predictors()
    holder, idle = mixed("m0", 3), mixed("m1")
    # the stall: the prefill's compute there times (streams + 1); the holder computes 192 tokens, not 8192
    assert pred.prefill_s(192, 8000) * 4 < pred.prefill_s(8192, 0) * 1
    req = request(8192, cached={"m0": 8000}, slo=Slo(ttft_s=5.0, tbt_s=1.0))
    d = KvCacheAwarePolicy(predictors=pred, allow_pull=False).decide(req, snapshot(holder, idle))
    assert d.prefill == "m0"
    # where the idle worker may pull the prefix it computes as little and pauses no stream
    pulled = KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(holder, idle))
    assert (pulled.prefill, pulled.pull_from, pulled.pull_tokens) == ("m1", "m0", 8000)


def test_only_workers_whose_ttft_fits_the_slack() -> None:
    pred = predictors()
    crowded, backlog = mixed("m0", 12), queued("m1", 1, 60_000)
    req = request(4096, slo=Slo(ttft_s=5.0, tbt_s=1.0))
    ttft_backlog = pred.queue_s(backlog.prefill_queue) + pred.prefill_s(4096, 0)
    slack = 0.9 * ttft_backlog / 5.0  # m1's TTFT just outside: the lowest TTFT decides
    assert 0 < slack <= 1
    calm_enough = KvCacheAwarePolicy(predictors=pred, ttft_quantile=None, mixed_ttft_slack=min(1.0, 1.1 * slack / 0.9))
    too_slow = KvCacheAwarePolicy(predictors=pred, ttft_quantile=None, mixed_ttft_slack=slack)
    assert too_slow.decide(req, snapshot(crowded, backlog)).prefill == "m0"
    assert calm_enough.decide(req, snapshot(crowded, backlog)).prefill == "m1"


def test_mixed_ttft_slack_is_checked() -> None:
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="mixed_ttft_slack"):
            KvCacheAwarePolicy(predictors=predictors(), mixed_ttft_slack=bad)


# ---- admission: the streams a prefill would pause (mixed_protect_streams) ----------------------


def short_streams(iid: str, n: int, remaining: int) -> InstanceView:
    return InstanceView(iid, Role.MIXED, decodes=tuple(ActiveDecode(2000, remaining) for _ in range(n)))


def test_a_prefill_goes_where_the_streams_can_absorb_it() -> None:
    pred = predictors()
    # m0: 4 streams with 2 tokens left each, the lower TTFT; m1: 4 streams with 400 tokens left,
    # behind a queued prefill (higher TTFT, within the slack). A 4096-token pause is spread over
    # 400 tokens on m1, over 2 on m0
    ending, long = (
        short_streams("m0", 4, 2),
        InstanceView(
            "m1",
            Role.MIXED,
            decodes=tuple(ActiveDecode(2000, 400) for _ in range(4)),
            prefill_queue=(QueuedPrefill(500, 0, 0.0),),
        ),
    )
    stall, slo_tbt = pred.prefill_s(4096, 0), 0.03
    spare = slo_tbt - pred.tbt_s(5, 4 * 2000 + 4096)
    assert stall > spare * 2 and stall < spare * 400  # the premise: m0's streams cannot absorb it, m1's can
    req = request(4096, slo=Slo(ttft_s=5.0, tbt_s=slo_tbt))
    unprotected = KvCacheAwarePolicy(predictors=pred, mixed_protect_streams=False).decide(req, snapshot(ending, long))
    assert unprotected.prefill == "m0"  # the fewest stream-seconds stalled, blind to how few tokens they have left
    d = KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(ending, long))
    assert (d.prefill, d.rejected) == ("m1", False)


def test_rejected_where_no_worker_can_absorb_it() -> None:
    pred = predictors()
    req = request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.03))
    cluster = snapshot(short_streams("m0", 4, 2), short_streams("m1", 3, 1))
    d = KvCacheAwarePolicy(predictors=pred).decide(req, cluster)
    assert d.rejected and d.rejection is not None and d.rejection.reason == "tbt_slo"
    assert "would pause more than a tenth" in d.rejection.message and d.rejection.retry_after_s >= 1.0
    # without admission it is placed all the same: the check is admission's
    assert not KvCacheAwarePolicy(predictors=pred, admission="none").decide(req, cluster).rejected
    # one stream in ten may be short: 10 streams, one about to end, are not a reason to refuse
    long_ones = [ActiveDecode(2000, 4000) for _ in range(9)]
    mostly_long = InstanceView("m2", Role.MIXED, decodes=(ActiveDecode(2000, 1), *long_ones))
    assert not KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(mostly_long)).rejected


def test_without_the_slack_the_lowest_ttft_whose_streams_absorb_it() -> None:
    pred = predictors()
    ending = short_streams("m0", 4, 2)  # the lowest TTFT; its streams cannot absorb the prefill
    long = InstanceView(
        "m1", Role.MIXED, decodes=tuple(ActiveDecode(2000, 400) for _ in range(4)), prefill_queue=(QueuedPrefill(500, 0, 0.0),)
    )
    req = request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.03))
    d = KvCacheAwarePolicy(predictors=pred, mixed_ttft_slack=None).decide(req, snapshot(ending, long))
    assert (d.prefill, d.rejected) == ("m1", False)
    assert (
        KvCacheAwarePolicy(predictors=pred, mixed_ttft_slack=None, mixed_protect_streams=False)
        .decide(req, snapshot(ending, long))
        .prefill
        == "m0"
    )


def watched_streams(iid: str, n: int, remaining: int, generated: int, took_s: float) -> InstanceView:
    """n streams the gateway relayed: `generated` tokens so far, the first `took_s` before the
    snapshot's now (100.0), `remaining` still to come."""
    first = 100.0 - took_s
    return InstanceView(iid, Role.MIXED, decodes=tuple(ActiveDecode(2000, remaining, True, generated, first) for _ in range(n)))


def test_streams_that_ran_ahead_of_their_tbt_slo_absorb_a_prefill_near_their_end() -> None:
    pred = predictors()
    req = request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.03))
    stall = pred.prefill_s(4096, 0)
    # 2 tokens left each, as in test_rejected_where_no_worker_can_absorb_it, but watched: 400 tokens
    # came at a third of the SLO's pace, 399 intervals x 0.02 s saved, far more than the pause
    saved = 0.03 * 399 - 0.01 * 399
    assert stall < saved
    ahead = watched_streams("m0", 4, 2, 400, 0.01 * 399)
    assert not KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(ahead)).rejected
    # the same streams, behind their pace (each interval took the SLO): nothing saved, refused as before
    behind = watched_streams("m0", 4, 2, 400, 0.03 * 399)
    d = KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(behind))
    assert d.rejected and d.rejection is not None and "would pause more than a tenth" in d.rejection.message
    # saved, but not enough for this pause: 2 intervals at a third of the pace save 0.04 s, and
    # 2 tokens left have at most the whole SLO each to spare
    few = watched_streams("m0", 4, 2, 3, 0.01 * 2)
    assert stall > 0.02 * 2 + 0.03 * 2
    assert KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(few)).rejected


# ---- the TBT bound no lower than the streams' pace (mixed_pace_floor) --------------------------


def test_observed_pace_pools_the_watched_streams() -> None:
    # 3 streams of 5 tokens, the first 1.35 s ago: each is half an interval into its fifth
    paced = watched_streams("m0", 3, 500, 5, 1.35)
    assert observed_pace_s(paced, 100.0) == pytest.approx(1.35 / 4.5)
    # too few intervals seen (1.5 each, 4 needed in all), and streams not watched, tell nothing
    assert observed_pace_s(watched_streams("m0", 2, 500, 2, 0.3), 100.0) is None
    assert observed_pace_s(mixed("m0", 8), 100.0) is None


def test_a_worker_whose_streams_lag_is_judged_by_their_pace() -> None:
    # a model several times too fast (a profile from another GPU, before its first refit): every
    # worker's predicted TBT fits the SLO, but the streams on m0 get a token every 0.3 s
    pred = predictors()
    slo = Slo(ttft_s=5.0, tbt_s=0.1)
    assert pred.tbt_s(4, 8192 + 3 * 2000) < 0.1
    lagging, keeping_up = watched_streams("m0", 3, 500, 5, 1.35), watched_streams("m1", 3, 500, 5, 0.09)
    blind_policy = KvCacheAwarePolicy(predictors=pred, mixed_pace_floor=False)
    blind = blind_policy.decide(request(4096, slo=slo), snapshot(lagging, keeping_up))
    assert (blind.prefill, blind.rejected) == ("m0", False)  # equal in every prediction: the first
    paced = KvCacheAwarePolicy(predictors=pred, mixed_pace_floor=True)
    d = paced.decide(request(4096, slo=slo), snapshot(lagging, keeping_up))
    assert (d.prefill, d.rejected) == ("m1", False)
    # the decision log shows the pace the chosen worker's bound was held above
    chosen = [c for c in d.candidates if c.predicted_tbt_s is not None and c.instance_id == "m1"]
    assert chosen[0].detail["streams_pace_s"] == pytest.approx(0.09 / 4.5)
    # where every worker's streams lag, admission refuses what the model alone would admit
    assert not blind_policy.decide(request(4096, slo=slo), snapshot(lagging)).rejected
    assert paced.decide(request(4096, slo=slo), snapshot(lagging)).rejected
    # without admission it is still placed, by the same rule
    unjudged = KvCacheAwarePolicy(predictors=pred, admission="none", mixed_pace_floor=True)
    assert unjudged.decide(request(4096, slo=slo), snapshot(lagging, keeping_up)).prefill == "m1"


def test_a_decision_on_mixed_workers_predicts_with_the_newest_legs_scale() -> None:
    """`Predictors.mixed_scale` (what the newest mixed legs ran over the fit) scales a mixed
    decision's queue and prefill; a disaggregated decision's prefill is not a mixed leg."""
    pred = predictors()
    req = request(4096, slo=Slo(ttft_s=5.0, tbt_s=0.5))
    worker = InstanceView("m0", Role.MIXED, prefill_queue=(QueuedPrefill(2048, 0, 0.0),), decodes=streams(3))
    pd = snapshot(prefill("p0", queued=1), decode("d0", 3))
    before = KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(worker)).predicted_ttft_s
    before_pd = KvCacheAwarePolicy(predictors=pred).decide(req, pd).predicted_ttft_s
    pred.mixed_scale = 1.5
    assert KvCacheAwarePolicy(predictors=pred).decide(req, snapshot(worker)).predicted_ttft_s == pytest.approx(1.5 * before)
    assert KvCacheAwarePolicy(predictors=pred).decide(req, pd).predicted_ttft_s == before_pd
