"""Baselines judged by kvcache_aware's online-fitted predictors and admission (`fit_predictors`),
so a baseline and kvcache_aware can be compared with the same admission control."""

from __future__ import annotations

import argparse

from conductor.core.types import ClusterSnapshot, Decision, Observation, RequestView
from traces.formats import load_trace, resolve_trace
from traces.sim.engine import simulate
from traces.sim.options import add_cluster_args, add_policy_args, apply_policy_args, config_from_args
from traces.sim.runner import FittedAdmission, PolicySpec, build_policy

HEAD = "conversation-head400"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_policy_args(parser)
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


class Spy:
    """Wraps a policy; keeps its decisions."""

    def __init__(self, inner: FittedAdmission) -> None:
        self.inner = inner
        self.name = inner.name
        self.decisions: list[tuple[int, Decision]] = []

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        return self.inner.decide(request, cluster)

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        self.decisions.append((request.seq, decision))
        self.inner.on_decided(request, cluster, decision)

    def observe(self, observation: Observation) -> None:
        self.inner.observe(observation)


def test_round_robin_with_fitted_predictors_learns_and_admits_like_kvcache_aware() -> None:
    # 2P+2D at 4x the trace's speed with a 4 s TTFT SLO: overloaded, so admission must reject
    config = config_from_args(_args("--paper", "--speedup", "4", "--slo-ttft", "4"), 2, 2)
    reqs = load_trace(resolve_trace(HEAD)).requests
    policy = build_policy(PolicySpec.parse("round_robin:fit_predictors=true"), config)
    assert isinstance(policy, FittedAdmission) and policy.judge.admission.value == "predicted"
    spy = Spy(policy)
    refits_before = policy.judge.predictors.refits
    res = simulate(spy, reqs, config)
    assert policy.judge.predictors.refits > refits_before  # the predictors learned from round robin's outcomes
    assert res.rejections.get("ttft_slo", 0) > 0
    admitted = [(seq, d) for seq, d in spy.decisions if d.rejection is None]
    assert admitted and all(d.prefill == f"prefill-{seq % 2}" and d.decode == f"decode-{seq % 2}" for seq, d in admitted)
    assert all(d.predicted_ttft_s is not None and d.pull_tokens == 0 for _, d in admitted)
    assert res.ttft_prediction.count == res.completed


def test_without_fit_predictors_a_baseline_is_itself() -> None:
    config = config_from_args(_args("--paper"), 2, 2)
    policy = build_policy(PolicySpec.parse("round_robin"), config)
    assert not isinstance(policy, FittedAdmission) and policy.name == "round_robin"
    res = simulate(policy, load_trace(resolve_trace(HEAD), limit=100).requests, config)
    assert res.ttft_prediction.count == 0


def test_cli_options_reach_every_spec_that_does_not_set_them() -> None:
    args = _args("--admission", "early", "--fit-predictors")
    specs = apply_policy_args([PolicySpec.parse("least_loaded"), PolicySpec.parse("random:admission=none")], args)
    assert specs[0].options == {"admission": "early", "fit_predictors": True}
    assert specs[0].label == "least_loaded:admission=early:fit_predictors=true"
    assert specs[1].options == {"admission": "none", "fit_predictors": True}
    policy = build_policy(specs[0], config_from_args(args, 2, 2))
    assert isinstance(policy, FittedAdmission) and policy.judge.admission.value == "early"
    # kvcache_aware fits its own predictors: the option leaves it as it is
    own = build_policy(PolicySpec("kvcache_aware", {"fit_predictors": True}), config_from_args(args, 2, 2))
    assert not isinstance(own, FittedAdmission)
