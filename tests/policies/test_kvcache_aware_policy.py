"""The KVCache-aware policy: where it sends a request, when it pulls a prefix, how it learns."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from types import MappingProxyType

import pytest

from conductor.core.types import (
    ActiveDecode,
    CachedPrefix,
    InstanceView,
    Observation,
    PrefillLeg,
    QueuedPrefill,
    Role,
    Slo,
    Tier,
)
from policies.estimate import pull_threshold
from policies.kvcache_aware import KvCacheAwarePolicy
from predictors import LinearModel, OnlineConfig, PredictorParams, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import decode, prefill, request, routed, snapshot


@pytest.fixture(scope="module")
def params() -> PredictorParams:
    return fit_profiles([bundled_profile()])


def with_link(params: PredictorParams, latency_s: float, bytes_per_s: float) -> PredictorParams:
    link = LinearModel((latency_s, 1.0 / bytes_per_s))
    return replace(params, transfer=MappingProxyType({"instance": link, "store": link}))


def policy(params: PredictorParams, **kw: object) -> KvCacheAwarePolicy:
    return KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig(enabled=False)), **kw)  # type: ignore[arg-type]


def test_busy_holder_pull_prefix_to_idle_instance_when_transfer_is_cheap(params: PredictorParams) -> None:
    # p0 holds 6144 of the 8192 prompt tokens but has ~0.7 s of prefill queued; p1 is idle
    cluster = snapshot(prefill("p0", queued=4), prefill("p1"), decode("d0"))
    d = policy(params).decide(request(cached={"p0": 6144}), cluster)
    assert (d.prefill, d.decode, d.pull_from, d.pull_tokens) == ("p1", "d0", "p0", 6144)
    p0, p1 = d.candidates[0], d.candidates[1]
    assert p0.detail["queue_s"] > 0.5 and p0.detail["pulled_tokens"] == 0 and p0.detail["cached_tokens"] == 6144
    assert p1.detail["pulled_tokens"] == 6144 and 0 < p1.detail["transfer_s"] < 0.05
    # TTFT is the sum of its parts, and the decision carries the winner's
    parts = ("transfer_s", "queue_s", "prefill_s", "handoff_s")
    assert p1.predicted_ttft_s == pytest.approx(sum(p1.detail[k] for k in parts))
    assert p1.predicted_ttft_s is not None and p0.predicted_ttft_s is not None and d.predicted_ttft_s is not None
    assert p1.predicted_ttft_s < p0.predicted_ttft_s
    # at the client: the leg, then the decode leg (handoff, ~1.5 decode steps, HTTP) in place of the handoff
    pred = policy(params).predictors
    tbt = d.candidates[2].detail["admission_tbt_s"]
    leg = sum(p1.detail[k] for k in ("transfer_s", "queue_s", "prefill_s"))
    assert d.predicted_ttft_s == pytest.approx(leg + pred.first_token_s(p1.detail["handoff_s"], tbt))
    assert d.predicted_ttft_s > p1.predicted_ttft_s


def test_busy_holder_recompute_elsewhere_when_transfer_is_dear(params: PredictorParams) -> None:
    slow = with_link(params, 0.005, 1e9)  # 1 GB/s: 6144 tokens of KV take ~0.9 s to move
    cluster = snapshot(prefill("p0", queued=4), prefill("p1"), decode("d0"))
    d = policy(slow).decide(request(cached={"p0": 6144}), cluster)
    assert (d.prefill, d.pull_from, d.pull_tokens) == ("p1", None, 0)
    p1 = d.candidates[1]
    assert p1.detail["transfer_s"] == 0 and p1.detail["cached_tokens"] == 0


def test_idle_holder_keeps_its_prefix(params: PredictorParams) -> None:
    cluster = snapshot(prefill("p0"), prefill("p1"), decode("d0"))
    d = policy(params).decide(request(cached={"p1": 6144}), cluster)
    assert (d.prefill, d.pull_from, d.pull_tokens) == ("p1", None, 0)


def test_pull_threshold_is_the_derived_break_even(params: PredictorParams) -> None:
    mid = with_link(params, 0.005, 10e9)
    pred = Predictors(mid)
    d_star = pull_threshold(pred, 0)
    assert 200 < d_star < 5000
    assert pull_threshold(pred, 6000) < d_star  # a longer local context makes recomputing dearer
    cluster = snapshot(prefill("p0"), prefill("p1", queued=20), decode("d0"))
    for prefix, pulls in ((math.ceil(d_star) + 64, True), (math.floor(d_star) - 64, False)):
        d = policy(mid).decide(request(cached={"p1": prefix}), cluster)
        assert d.prefill == "p0"
        assert (d.pull_tokens > 0) is pulls, (prefix, d_star)


def test_store_prefix_pulled_over_the_store_link(params: PredictorParams) -> None:
    store_only = replace(params, transfer=MappingProxyType({**params.transfer, "store": LinearModel((0.001, 1e-11))}))
    d = policy(store_only).decide(request(store=4096), snapshot(prefill("p0"), decode("d0")))
    assert (d.pull_from, d.pull_tokens) == ("store", 4096)
    # a store-tier entry in the index counts as remote too, never as local reuse
    d = policy(params).decide(request(cached={"p0": CachedPrefix(4096, Tier.STORE)}), snapshot(prefill("p0"), decode("d0")))
    assert d.pull_tokens == 4096 and d.pull_from == "store"


def test_no_pull_option(params: PredictorParams) -> None:
    cluster = snapshot(prefill("p0", queued=4), prefill("p1"), decode("d0"))
    d = policy(params, allow_pull=False).decide(request(cached={"p0": 6144}), cluster)
    assert d.pull_tokens == 0 and d.pull_from is None


def test_only_pulls_the_cluster_can_carry_out_are_planned(params: PredictorParams) -> None:
    # the same busy holder as above; the gateway says no instance can be pulled from (no mechanism)
    cluster = snapshot(prefill("p0", queued=4), prefill("p1"), decode("d0"))
    d = policy(params).decide(replace(request(cached={"p0": 6144}), pull_sources={}), cluster)
    assert d.pull_from is None and d.pull_tokens == 0
    p1 = d.candidates[1]
    assert p1.detail["cached_tokens"] == 0 and p1.detail["transfer_s"] == 0
    # a decode's readback of the last turn is offered: the idle prefill pulls from it, not from p0
    d = policy(params).decide(replace(request(cached={"p0": 6144}), pull_sources={"d0": 6144}), cluster)
    assert (d.prefill, d.pull_from, d.pull_tokens) == ("p1", "d0", 6144)
    # and with the prefix offered by the decode, a prefill that holds none of it pulls it
    d = policy(params).decide(replace(request(), pull_sources={"d0": 4096}), snapshot(prefill("p0"), decode("d0")))
    assert (d.pull_from, d.pull_tokens) == ("d0", 4096)


def test_decode_with_lowest_predicted_tbt(params: PredictorParams) -> None:
    cluster = snapshot(prefill("p0"), decode("d0", streams=64, remaining=5000), decode("d1", streams=8))
    d = policy(params).decide(request(), cluster)
    assert d.decode == "d1"
    d0, d1 = d.candidates[1], d.candidates[2]
    assert d0.predicted_tbt_s is not None and d1.predicted_tbt_s is not None
    assert d1.predicted_tbt_s < d0.predicted_tbt_s
    # the decision's TBT is the forecast for when the request arrives (streams grown meanwhile)
    assert d.predicted_tbt_s == pytest.approx(d1.predicted_tbt_s, rel=0.01)


def test_mixed_workers_check_tbt_on_the_same_worker(params: PredictorParams) -> None:
    busy = tuple(ActiveDecode(8000, 5000) for _ in range(200))
    m0 = InstanceView("m0", Role.MIXED, decodes=busy)
    m1 = InstanceView("m1", Role.MIXED)
    cluster = snapshot(m0, m1)
    # m0 holds the prefix: fastest TTFT, but its decode batch would break the TBT SLO
    d = policy(params).decide(request(cached={"m0": 8000}, slo=Slo(ttft_s=5.0, tbt_s=0.05)), cluster)
    assert (d.prefill, d.decode) == ("m1", None) and not d.rejected
    d = policy(params).decide(request(cached={"m0": 8000}), cluster)
    assert d.prefill == "m0" and d.pull_tokens == 0


def test_unhealthy_and_missing_pools(params: PredictorParams) -> None:
    sick = replace(prefill("p1"), healthy=False)
    d = policy(params).decide(request(cached={"p1": 8000}), snapshot(prefill("p0", queued=10), sick, decode("d0")))
    assert d.prefill == "p0"  # never an unhealthy one, however good its cache (but it may pull from it)
    d = policy(params).decide(request(), snapshot(prefill("p0")))
    assert d.rejected and d.rejection is not None and d.rejection.reason == "no_instance"


def test_observations_refit_predictors_and_track_errors(params: PredictorParams) -> None:
    pol = KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig(refit_every=8, min_samples=8)))
    cluster = snapshot(prefill("p0"), decode("d0", streams=4))
    before = pol.predictors.prefill_s(4000, 0)
    for i in range(24):  # the machine is twice as slow as the profile says
        req = request(prompt=4000, rid=f"r{i}")
        d = routed(pol, req, cluster)
        assert d.predicted_ttft_s is not None
        leg = 2 * pol.predictors.prefill_s(4000, 0)
        pol.observe(
            Observation(
                req.request_id,
                d.prefill,
                d.decode,
                4000,
                0,
                0,
                leg,
                leg + 0.01,
                token_intervals_s=(0.02,) * 10,
                output_tokens=10,
                decode_batch=4,
                decode_resident_kv_tokens=8000,
            )
        )
    assert pol.predictors.refits >= 2
    assert pol.predictors.prefill_s(4000, 0) > 1.5 * before
    comps = {s.component for s in pol.error_stats()}
    assert {"prefill", "queue_and_prefill", "ttft", "tbt", "tbt_at_decision"} <= comps


def test_queued_legs_teach_the_prefill_model_through_the_fcfs_queue(params: PredictorParams) -> None:
    """A leg behind an FCFS queue is the head's remainder + the others' prefills + its own: every
    queued leg is a sample of the same coefficients, so the model learns under sustained load."""
    pol = KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig(refit_every=8, min_samples=8)))
    truth = Predictors(params.scaled(prefill=1.3), OnlineConfig(enabled=False))
    rng = random.Random(3)
    for i in range(64):
        k, n, elapsed = rng.randint(1, 6), rng.randint(1000, 8000), rng.uniform(0.0, 0.1)
        queue = tuple(QueuedPrefill(rng.randint(1000, 8000), 0, elapsed if j == 0 else 0.0) for j in range(k))
        cluster = snapshot(InstanceView("p0", Role.PREFILL, prefill_queue=queue), decode("d0"))
        req = request(prompt=n, rid=f"q{i}")
        d = routed(pol, req, cluster)
        leg = truth.queue_s(queue) + truth.prefill_s(n, 0)  # exact FCFS: the queue is never empty
        pol.observe(Observation(req.request_id, d.prefill, d.decode, n, 0, 0, leg, leg + 0.02))
    assert pol.predictors.refits >= 4
    for n in (1000, 4000, 8000):
        assert pol.predictors.prefill_s(n, 0) == pytest.approx(truth.prefill_s(n, 0), rel=0.05)
    stats = {s.component: s for s in pol.error_stats()}
    assert stats["queue_and_prefill"].samples == 64


def test_a_prefill_leg_teaches_when_told_and_not_again_from_the_observation(params: PredictorParams) -> None:
    """Workers 3x slower than the profile: the first 8 legs, told as they end (before any request's
    decode is over), already correct the prefill model; the Observations that follow teach the
    decode leg and the TBT but add no second sample of a leg."""
    pol = KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig()))
    lessons = pol.predictors.record_lessons()
    cluster = snapshot(prefill("p0"), decode("d0"))
    truth = 3 * pol.predictors.prefill_s(4000, 0)
    decided = []
    for i in range(8):
        req = request(prompt=4000, rid=f"c{i}")
        d = routed(pol, req, cluster)
        pol.observe_prefill_leg(PrefillLeg(req.request_id, "p0", 4000, 0, truth))
        decided.append((req, d))
    assert [lesson[0] for lesson in lessons] == ["leg"] * 8
    assert pol.predictors.refits == 1  # the young window's first refit, at 8 samples
    assert pol.predictors.prefill_s(4000, 0) == pytest.approx(truth, rel=0.1)
    lessons.clear()
    for req, d in decided:
        pol.observe(
            Observation(
                req.request_id,
                d.prefill,
                d.decode,
                4000,
                0,
                0,
                truth,
                truth + 0.05,
                token_intervals_s=(0.02,) * 4,
                output_tokens=4,
            )
        )
    assert "leg" not in {lesson[0] for lesson in lessons}
    assert {lesson[0] for lesson in lessons} == {"decode_leg", "tbt"}
    # a leg from another instance than the one chosen, or of a request never placed, is not learned
    req = request(prompt=4000, rid="other")
    routed(pol, req, cluster)
    pol.observe_prefill_leg(PrefillLeg("other", "p9", 4000, 0, truth))
    pol.observe_prefill_leg(PrefillLeg("never-placed", "p0", 4000, 0, truth))
    assert "leg" not in {lesson[0] for lesson in lessons}


def test_a_mixed_leg_teaches_at_its_first_token_and_not_again_from_the_observation(params: PredictorParams) -> None:
    """A mixed stream's leg told at its first token (PrefillLeg, from arrival, no cached tokens yet)
    is one sample of the mixed fit; the Observation after it, whose ttft_s is that leg, teaches the
    TBT only. A leg told for another worker than the one chosen is not learned."""
    pol = KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig()))
    lessons = pol.predictors.record_lessons()
    cluster = snapshot(InstanceView("m0", Role.MIXED))
    truth = 3 * pol.predictors.prefill_s(4000, 0)
    decided = []
    for i in range(8):
        req = replace(request(prompt=4000, rid=f"x{i}"), stream=True)
        d = routed(pol, req, cluster)
        assert (d.prefill, d.decode) == ("m0", None)
        pol.observe_prefill_leg(PrefillLeg(req.request_id, "m0", 4000, None, truth))
        decided.append(req)
    assert [lesson[0] for lesson in lessons] == ["mixed_leg"] * 8
    assert pol.predictors.refits == 1  # the young window's first refit, at 8 samples: before any stream ended
    lessons.clear()
    for req in decided:
        intervals = (0.02,) * 4
        pol.observe(
            Observation(req.request_id, "m0", None, 4000, 0, 0, None, truth, token_intervals_s=intervals, output_tokens=5)
        )
    assert [lesson[0] for lesson in lessons] == ["tbt"] * 8
    req = replace(request(prompt=4000, rid="elsewhere"), stream=True)
    routed(pol, req, cluster)
    pol.observe_prefill_leg(PrefillLeg("elsewhere", "m1", 4000, None, truth))
    assert "mixed_leg" not in {lesson[0] for lesson in lessons}
    pol.observe(Observation("elsewhere", "m0", None, 4000, 0, 0, None, truth))  # not told early: learned here
    assert [lesson[0] for lesson in lessons][-1] == "mixed_leg"


def test_pending_predictions_are_bounded(params: PredictorParams) -> None:
    pol = policy(params, max_pending=4)
    cluster = snapshot(prefill("p0"), decode("d0"))
    for i in range(10):
        routed(pol, request(rid=f"b{i}"), cluster)
    assert len(pol.learner.pending) == 4 and "b9" in pol.learner.pending and "b0" not in pol.learner.pending
    pol.observe(Observation("b0", "p0", "d0", 8192, 0, 0, 0.5, 0.5))  # forgotten: ignored, no error
    assert pol.error_stats() == ()


def test_rejecting_everything_still_probes_so_it_can_learn() -> None:
    policy = KvCacheAwarePolicy(probe_after=5)
    cluster = snapshot(prefill("p0"), decode("d0"))
    tight = Slo(ttft_s=1e-6, tbt_s=None)  # nothing can meet it: every prediction says reject
    outcomes = []
    for i in range(12):
        d = routed(policy, request(4096, slo=tight, rid=f"r{i}"), cluster)
        outcomes.append(d.rejected)
    assert outcomes == [True] * 5 + [False] + [True] * 5 + [False]
    never = KvCacheAwarePolicy(probe_after=None)
    assert all(routed(never, request(4096, slo=tight, rid=f"n{i}"), cluster).rejected for i in range(12))


def test_a_staged_pull_counts_the_holders_wait(params: PredictorParams) -> None:
    # p0 holds the prefix behind 4 queued prefills, the first of them nearly done; p1 is idle. A
    # direct peer pull is quick, so p1 pulls; a pull that must first stage through p0's FCFS queue
    # waits for all 4 (costlier than recomputing on p1); one that jumps the queue (priority
    # staging) waits only for the rest of p0's running prefill
    pred = Predictors(params)
    running = QueuedPrefill(8000, 0, pred.prefill_s(8000, 0) * 0.9)
    queue = (running, *(QueuedPrefill(8000, 0, 0.0) for _ in range(3)))
    cluster = snapshot(InstanceView("p0", Role.PREFILL, prefill_queue=queue), prefill("p1"), decode("d0"))
    base = replace(request(cached={"p0": 6144}), pull_sources={"p0": 6144})
    direct = policy(params).decide(base, cluster)
    assert (direct.prefill, direct.pull_from, direct.pull_tokens) == ("p1", "p0", 6144)
    fcfs = policy(params).decide(replace(base, queued_pull_sources=frozenset({"p0"})), cluster)
    assert fcfs.prefill == "p1" and fcfs.pull_from is None and fcfs.pull_tokens == 0
    jumps = policy(params).decide(replace(base, queued_pull_sources=frozenset({"p0"}), staging_jumps_queue=True), cluster)
    assert (jumps.prefill, jumps.pull_from) == ("p1", "p0")
    head = pred.queue_s(cluster.instances[0].prefill_queue[:1]) + pred.prefill_s(1, 8192)
    p1 = next(c for c in jumps.candidates if c.instance_id == "p1")
    assert p1.detail["transfer_s"] == pytest.approx(pred.transfer_s(6144, "instance") + head)
    assert p1.detail["transfer_s"] > next(c for c in direct.candidates if c.instance_id == "p1").detail["transfer_s"]


def test_a_mixed_workers_first_token_teaches_the_prefill_model(params: PredictorParams) -> None:
    """A mixed worker reports no prefill leg: its streamed TTFT (queue, prefill, the sampling step)
    is the leg, so the prefill model learns there too instead of keeping its starting profile."""
    pol = KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig(refit_every=8, min_samples=8)))
    truth = Predictors(params.scaled(prefill=1.6), OnlineConfig(enabled=False))
    rng = random.Random(5)
    for i in range(64):
        n = rng.randint(1000, 8000)
        cluster = snapshot(InstanceView("m0", Role.MIXED))
        req = replace(request(prompt=n, rid=f"m{i}"), stream=True)
        d = routed(pol, req, cluster)
        assert d.prefill == "m0"
        ttft = truth.prefill_s(n, 0)
        pol.observe(Observation(req.request_id, d.prefill, d.decode, n, 0, 0, None, ttft))
    assert pol.predictors.refits >= 4
    for n in (1000, 4000, 8000):
        assert pol.predictors.prefill_s(n, 0) == pytest.approx(truth.prefill_s(n, 0), rel=0.05)
