"""`judged` (policies/judged.py): a baseline places, kvcache_aware's `judge` admits (issue 39's
"round_robin with the same admission"). Round robin under it places exactly where round robin
does, is rejected exactly where kvcache_aware's judge predicts a miss for that placement, passes
every hook the gateway calls on to the judge, and a bad option stops start-up naming the key."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from conductor.core.capabilities import ClassAware, LocalPrefiller, ReportsPredictionErrors, online_learner
from conductor.core.classes import ClassRules
from conductor.core.errors import ConfigError, PluginError
from conductor.core.types import (
    ClusterSnapshot,
    InstanceView,
    Observation,
    PrefillLeg,
    PrefillLegObserver,
    RequestView,
    Role,
    Slo,
)
from policies.admission import TTFT_SLO
from policies.judged import JUDGE_KEYS, PLACEMENT_KEYS, JudgedPolicy, judged
from policies.kvcache_aware import OPTION_KEYS, KvCacheAwarePolicy
from policies.registry import load_policy
from policies.round_robin import RoundRobinPolicy
from tests.policies.cluster_builders import decode, prefill, request, routed, snapshot


def _rr(**options: object) -> JudgedPolicy:
    policy = load_policy("judged", {"place": "round_robin", **options})  # as the gateway loads it
    assert isinstance(policy, JudgedPolicy)
    return policy


def _nth(req: RequestView, seq: int) -> RequestView:
    return replace(req, request_id=f"r{seq}", seq=seq)


# two prefills, one of them with a long queue; two decodes, one of them busy
LOADED = snapshot(prefill("p0"), prefill("p1", queued=6), decode("d0"), decode("d1", streams=40))


def test_places_exactly_as_round_robin_does() -> None:
    policy, plain = _rr(), RoundRobinPolicy()
    mixed = snapshot(*(InstanceView(f"m{i}", Role.MIXED) for i in range(3)))
    for cluster in (LOADED, mixed):
        for seq in range(12):
            req = _nth(request(prompt=2048), seq)  # no SLO: nothing is rejected
            decision, expected = routed(policy, req, cluster), plain.decide(req, cluster)
            assert (decision.prefill, decision.decode) == (expected.prefill, expected.decode)
            assert decision.rejection is None and decision.policy == "round_robin"
            assert decision.predicted_ttft_s is not None and decision.predicted_tbt_s is not None  # the judge's
            assert decision.pull_tokens == 0 and not decision.prefilled_on_decode
    assert policy.name == "judged(round_robin)"


def test_rejects_exactly_where_kvcache_aware_judges_a_miss() -> None:
    reference = KvCacheAwarePolicy(allow_pull=False)  # a fresh judge with kvcache_aware's defaults
    base = request(prompt=4096)
    idle = reference.judge(_nth(base, 0), LOADED, "p0", "d0")  # seq 0: round robin's p0 and d0
    assert idle.rejection is None and idle.predicted_ttft_s is not None
    slo = Slo(ttft_s=3 * idle.predicted_ttft_s)  # an idle prefill meets it, p1's queue does not
    policy, plain = _rr(), RoundRobinPolicy()
    outcomes = []
    for seq in range(6):
        req = replace(_nth(base, seq), slo=slo)
        decision = routed(policy, req, LOADED)
        expected = plain.decide(req, LOADED)
        assert expected.rejection is None  # round robin alone admits every one of them
        verdict = reference.judge(req, LOADED, expected.prefill or "", expected.decode)
        assert decision.rejection == verdict.rejection
        outcomes.append(decision.rejection.reason if decision.rejection else expected.prefill)
    assert outcomes == ["p0", TTFT_SLO] * 3  # p1 (odd seq) is queued past the SLO: rejected, never moved


def test_passes_the_gateways_hooks_to_the_judge() -> None:
    policy = _rr(refit_every=4, ttft_quantile=None)
    assert isinstance(policy, ClassAware | ReportsPredictionErrors | PrefillLegObserver)
    assert isinstance(policy, ReportsPredictionErrors) and isinstance(policy, PrefillLegObserver)
    assert online_learner(policy) is policy.judge.predictors and not isinstance(policy, LocalPrefiller)
    cluster = snapshot(prefill("p0"), prefill("p1"), decode("d0"), decode("d1"))
    refits = policy.judge.predictors.refits
    for seq in range(16):
        req = _nth(request(prompt=1024), seq)
        decision = routed(policy, req, cluster)
        assert decision.prefill is not None and decision.predicted_ttft_s is not None
        policy.observe_prefill_leg(PrefillLeg(req.request_id, decision.prefill, 1024, 0, 0.5))
        ttft = 2 * decision.predicted_ttft_s  # the cluster is slower than predicted
        policy.observe(Observation(req.request_id, decision.prefill, decision.decode, 1024, 0, 0, 0.5, ttft, (0.03,) * 8, 9))
    assert policy.judge.predictors.refits > refits  # learned from round robin's outcomes
    samples: dict[str, int] = {}
    for stat in policy.error_stats():  # per component and instance, as the gateway exports them
        samples[stat.component] = samples.get(stat.component, 0) + stat.samples
    assert samples.get("ttft") == 16 and samples.get("queue_and_prefill") == 16


def test_a_less_urgent_class_is_judged_by_the_guarded_slo_once_told() -> None:
    policy = _rr(ttft_quantile=None)  # judged on the point prediction, so the test can place the SLO
    cluster: ClusterSnapshot = snapshot(prefill("p0"), decode("d0"))
    probe = policy.decide(_nth(request(prompt=2048), 0), cluster)
    assert probe.predicted_ttft_s is not None
    urgent = Slo(ttft_s=1.5 * probe.predicted_ttft_s)
    batch = replace(_nth(request(prompt=2048), 0), slo=urgent, priority="batch")
    assert policy.decide(batch, cluster).rejection is None  # within its own SLO
    policy.configure_classes(ClassRules(ranks={"interactive": 0, "batch": 1}, urgent_slo=urgent, guard_margin=0.5))
    rejection = policy.decide(batch, cluster).rejection
    assert rejection is not None and rejection.reason == TTFT_SLO  # 0.75x the prediction: the guard


def test_every_kvcache_aware_option_is_either_the_judges_or_refused() -> None:
    assert set(JUDGE_KEYS) | set(PLACEMENT_KEYS) == set(OPTION_KEYS) and not set(JUDGE_KEYS) & set(PLACEMENT_KEYS)
    policy = _rr(admission="early", window=64, track_errors=False)
    assert policy.judge.admission == "early" and policy.judge.options.learning.window == 64
    assert not policy.judge.allow_pull and policy.judge.local is None and policy.judge.sessions is None
    spare = judged(place="least_loaded", place_options={"listed_candidates": 2})
    assert spare.inner.name == "least_loaded" and spare.name == "judged(least_loaded)"


@pytest.mark.parametrize(
    ("options", "key", "message"),
    [
        ({}, "place", "needs option 'place'"),
        ({"place": "no_such"}, "place", "'no_such', which is not a registered policy"),
        ({"place": "kvcache_aware"}, "place", "predictors and admission of its own"),
        ({"place": "judged", "place_options": {"place": "round_robin"}}, "place", "predictors and admission of its own"),
        ({"place": "round_robin", "place_options": {"seed": 1}}, "place_options", "RoundRobinPolicy"),
        ({"place": "round_robin", "place_options": [1]}, "place_options", "must be a mapping"),
        ({"place": "least_loaded", "place_options": {"admission": "predicted"}}, "place_options", "second admission"),
        ({"place": "round_robin", "ttft_slack": 0.5}, "ttft_slack", "steers kvcache_aware's own placement"),
        ({"place": "round_robin", "allow_pull": True}, "allow_pull", "steers kvcache_aware's own placement"),
        ({"place": "round_robin", "windw": 64}, "windw", "no option 'windw' (did you mean 'window'?)"),
        ({"place": "round_robin", "admission": "later"}, "admission", "'admission' must be one of none, early, predicted"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_the_key(options: dict[str, object], key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        judged(**options)
    assert caught.value.param == key
    # as the gateway loads it: the registry's PluginError carries the same message
    with pytest.raises(PluginError, match=f"'judged'.*failed to construct: .*{re.escape(message)}"):
        load_policy("judged", options)
