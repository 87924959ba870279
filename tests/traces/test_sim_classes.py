"""Priority classes and tenants in the simulator (traces/sim/classes.py, groups.py; issue 37), with the
gateway's code wired in by benchmarks/sim_gateway_classes.py: the request view carries them, the
policy is told the gateway's ClassRules, the gateway's in-flight shares refuse what they would live,
and the results add up per class and tenant."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from adapters.emulator.profile import load_profile
from benchmarks.sim_gateway_classes import sim_classes
from benchmarks.tenants_load import SHEDDABLE, URGENT, shapes, workload
from conductor.core.classes import ClassRules
from conductor.core.types import ClusterSnapshot, Decision, Observation, Policy, RequestView, Role, Slo
from policies.registry import load_policy
from predictors.profile import bundled_profile, fit_profiles
from traces.formats import TraceRequest
from traces.prompt_trace import prompt_trace
from traces.sim.classes import SimClasses
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.results import RunResult, format_table
from traces.sim.truth import truth_from_emulator

TIME_SCALE = 6.0
CLASSES = shapes(TIME_SCALE)
URGENT_SLO = Slo(CLASSES[URGENT].ttft_s, CLASSES[URGENT].tbt_s)


def _settings(limit: int | None = None) -> dict[str, Any]:
    """bench_tenants.py's classes and tenants, as a gateway settings dict."""
    u, b = CLASSES[URGENT], CLASSES[SHEDDABLE]
    out: dict[str, Any] = {
        "priority": {
            "classes": {
                URGENT: {"slo": {"ttft_s": u.ttft_s, "tbt_s": u.tbt_s}, "rank": 0},
                SHEDDABLE: {"slo": {"ttft_s": b.ttft_s, "tbt_s": b.tbt_s}, "rank": 1, "sheddable": True},
            },
            "default": URGENT,
        },
        "auth": {"tenants": {t: {"api_keys": [f"sk-test-tenant-{t.lower()}"], "weight": 1} for t in "AB"}},
        "slo": {"ttft_s": u.ttft_s, "tbt_s": u.tbt_s},
    }
    if limit is not None:
        out["limits"] = {"max_inflight_requests": limit}
    return out


def _config(classes: SimClasses | None, seed: int = 0) -> SimConfig:
    """4 mixed emulated workers at time scale 6, as benchmarks/bench_tenants.py runs them."""
    truth = truth_from_emulator(load_profile(), TIME_SCALE)
    return SimConfig(n_prefill=0, n_decode=4, mixed=True, truth=truth, slo=URGENT_SLO, seed=seed, pull="none", classes=classes)


def _trace(rates: dict[str, float], seed: int = 3, duration: float = 20.0) -> tuple[TraceRequest, ...]:
    return prompt_trace(workload(rates, 0.3, duration, CLASSES, seed))


@pytest.fixture(scope="module")
def params(tmp_path_factory: pytest.TempPathFactory) -> str:
    """kvcache_aware's predictor params scaled like the workers (bench_tenants.py's)."""
    path = tmp_path_factory.mktemp("params") / "predictor-params.json"
    fit_profiles([bundled_profile()]).scaled(TIME_SCALE, TIME_SCALE, TIME_SCALE).save(path)
    return str(path)


def _kvcache_aware(params: str) -> Policy:
    return load_policy("kvcache_aware", {"admission": "predicted", "listed_candidates": 1, "predictor_params": params})


class Recording:
    """round_robin over the mixed workers, recording what it is told and shown."""

    name = "recording"

    def __init__(self) -> None:
        self.inner = load_policy("round_robin")
        self.rules: list[ClassRules] = []
        self.views: list[RequestView] = []
        self.roles: set[Role] = set()

    def configure_classes(self, rules: ClassRules) -> None:
        self.rules.append(rules)

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.views.append(request)
        self.roles |= {i.role for i in cluster.instances}
        return self.inner.decide(request, cluster)

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        self.inner.on_decided(request, cluster, decision)

    def observe(self, observation: Observation) -> None:
        self.inner.observe(observation)


def test_the_policy_sees_each_requests_class_tenant_and_class_slo() -> None:
    trace = _trace({"A": 1.0, "B": 1.0})
    policy = Recording()
    simulate(policy, trace, _config(sim_classes(_settings())))
    (rules,) = policy.rules  # told once, before the first request, as the gateway does at start-up
    assert dict(rules.ranks) == {URGENT: 0, SHEDDABLE: 1}
    assert rules.sheddable == {SHEDDABLE} and rules.urgent_slo == URGENT_SLO and dict(rules.weights) == {"A": 1.0, "B": 1.0}
    assert policy.roles == {Role.MIXED}
    assert [(v.priority, v.tenant) for v in policy.views] == [(r.priority, r.tenant) for r in trace]
    batch = CLASSES[SHEDDABLE]
    for view in policy.views:
        assert view.slo == (URGENT_SLO if view.priority == URGENT else Slo(batch.ttft_s, batch.tbt_s))
    assert {v.priority for v in policy.views} == {URGENT, SHEDDABLE} and {v.tenant for v in policy.views} == {"A", "B"}


def test_without_classes_the_policy_sees_none() -> None:
    policy = Recording()
    simulate(policy, _trace({"A": 1.0, "B": 1.0}), _config(None))
    assert not policy.rules and {(v.priority, v.tenant, v.slo) for v in policy.views} == {(None, None, URGENT_SLO)}


def _check_groups_add_up(result: RunResult, n: int) -> None:
    g = result.groups
    assert g["all"]["sent"] == n == result.requests
    for figure in ("sent", "admitted", "met"):
        for parts in ([f"class:{URGENT}", f"class:{SHEDDABLE}"], ["tenant:A", "tenant:B"]):
            assert sum(g[p][figure] for p in parts) == g["all"][figure], (figure, parts)
        for t in "AB":
            assert g[f"tenant:{t}/{URGENT}"][figure] + g[f"tenant:{t}/{SHEDDABLE}"][figure] == g[f"tenant:{t}"][figure]
    assert g["all"]["admitted"] == result.requests - result.rejected
    assert g["all"]["met"] == result.slo_met
    missed = sum(v for k, v in g["all"].items() if k.startswith("missed:"))
    assert missed + g["all"]["met"] == n


def test_at_3x_overload_the_sheddable_class_is_shed_and_the_urgent_one_meets_its_slos(params: str) -> None:
    # 5 req/s is the live cluster's capacity (docs/benchmarks.md): 3x, half from each tenant
    trace = _trace({"A": 7.5, "B": 7.5})
    result = simulate(_kvcache_aware(params), trace, _config(sim_classes(_settings())))
    _check_groups_add_up(result, len(trace))
    urgent, batch = result.groups[f"class:{URGENT}"], result.groups[f"class:{SHEDDABLE}"]
    assert urgent["admitted_share"] >= 0.95
    # the sheddable class takes the shedding: 0.31, of which the waiting room (traces/sim/hold.py)
    # admits about 0.19 once streams end (0.12 with `hold_max` 0), every one meeting both SLOs
    assert batch["admitted_share"] <= 0.35
    assert urgent["met_admitted"] >= 0.9 and batch["met_admitted"] >= 0.95
    assert "class:batch admitted, met/admitted, met/sent" in format_table([result])


def test_the_gateways_shares_shed_the_sheddable_class_first() -> None:
    # round_robin admits everything: only the in-flight limit (8) and its shares refuse
    trace = _trace({"A": 4.0, "B": 4.0})
    result = simulate(load_policy("round_robin"), trace, _config(sim_classes(_settings(limit=8))))
    _check_groups_add_up(result, len(trace))
    urgent, batch = result.groups[f"class:{URGENT}"], result.groups[f"class:{SHEDDABLE}"]
    assert batch.get("missed:priority_shed", 0) > 0 and "missed:priority_shed" not in urgent
    assert urgent["admitted_share"] > batch["admitted_share"]


def test_a_flooding_tenant_is_held_to_its_share_of_the_inflight_limit() -> None:
    trace = _trace({"A": 0.5, "B": 8.0})
    result = simulate(load_policy("round_robin"), trace, _config(sim_classes(_settings(limit=8))))
    a, b = result.groups["tenant:A"], result.groups["tenant:B"]
    assert b.get("missed:tenant_share", 0) > 0 and "missed:tenant_share" not in a
    assert a["admitted_share"] > b["admitted_share"]


def test_an_unknown_class_fails_as_the_gateway_refuses_it() -> None:
    trace = [replace(r, priority="bulk") for r in _trace({"A": 1.0}, duration=2.0)]
    with pytest.raises(Exception, match="unknown priority class"):
        simulate(load_policy("round_robin"), trace, _config(sim_classes(_settings())))
    with pytest.raises(ValueError, match="sheddable"):
        bad = _settings()
        bad["priority"]["classes"][SHEDDABLE]["rank"] = 0
        sim_classes(bad)


def test_mixed_workers_reuse_their_tenants_system_prompt(params: str) -> None:
    result = simulate(_kvcache_aware(params), _trace({"A": 1.0, "B": 1.0}), _config(None))
    assert result.completed == result.requests and result.n_prefill == 0
    assert result.prefix_hit_local > 0.1  # the 256-token system prompts, from each worker's cache
    with pytest.raises(ValueError, match="mixed"):
        SimConfig(n_prefill=1, n_decode=4, mixed=True)
