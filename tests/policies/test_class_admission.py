"""Class- and tenant-aware admission in kvcache_aware (issue 37): a less urgent class judged by the
guarded SLO (policies/classes.py), a flooding tenant held to its share of the work admitted while
another tenant sends and the fleet is short of room or the flooder would take a worker decoding
streams, as long as that tenant is short of its max-min fair share (policies/kvcache_aware/fairness.py),
and the gateway telling the policy both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conductor.config.settings import load_settings
from conductor.core.classes import ClassRules
from conductor.core.types import (
    ActiveDecode,
    ClusterSnapshot,
    Decision,
    InstanceView,
    QueuedPrefill,
    Rejection,
    RequestView,
    Role,
    Slo,
)
from conductor.gateway import Gateway
from policies.classes import guard_slo, guarded
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.kvcache_aware.fairness import (
    ACTIVE_S,
    CONTEND_S,
    EVIDENCE,
    FLOOD,
    NEAR,
    TENANT_SHARE,
    TenantService,
    flooding,
    over_share,
    work,
)
from policies.kvcache_aware.prefill_duty import MIN_SPAN_S, WINDOW_S, PrefillDuty
from predictors import OnlineConfig, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import request, routed

URGENT_SLO = Slo(ttft_s=3.0, tbt_s=0.24)  # the bench's, seconds (time scale 6)
BATCH_SLO = Slo(ttft_s=60.0, tbt_s=0.9)
RULES = ClassRules(
    ranks={"interactive": 0, "batch": 1},
    sheddable=frozenset({"batch"}),
    urgent_slo=URGENT_SLO,
    guard_margin=0.5,
    weights={"A": 1.0, "B": 1.0},
)


def predictors() -> Predictors:
    return Predictors(fit_profiles([bundled_profile()]), OnlineConfig(enabled=False))


def policy(rules: ClassRules | None = RULES) -> KvCacheAwarePolicy:
    p = KvCacheAwarePolicy(predictors=predictors(), admission="predicted")
    if rules is not None:
        p.configure_classes(rules)
    return p


def of(cls: str, tenant: str | None = "A", prompt: int = 1024, rid: str = "r1", slo: Slo | None = None) -> RequestView:
    own = slo or (URGENT_SLO if cls == "interactive" else BATCH_SLO)
    return replace(request(prompt, slo=own, rid=rid), priority=cls, tenant=tenant)


def busy(n: int, at: float = 100.0) -> ClusterSnapshot:
    """Two mixed workers with `n` streams each (no worker idle: TBT is judged)."""
    streams = tuple(ActiveDecode(4000, 100) for _ in range(n))
    return ClusterSnapshot(at, (InstanceView("m0", Role.MIXED, decodes=streams), InstanceView("m1", Role.MIXED, decodes=streams)))


def scaled(n: int, high: float) -> Slo:
    """The urgent SLO scaled so that one more stream beside `n` per worker decodes at `high` x its TBT
    (the bundled profile is a fast GPU's: its TBTs are milliseconds)."""
    tbt = predictors().tbt_s(n + 1, 1024 + 128 + n * 4000)
    return Slo(ttft_s=URGENT_SLO.ttft_s, tbt_s=tbt / high)


# ---- the guarded SLO --------------------------------------------------------------------------------


def test_guard_slo_takes_the_tighter_field() -> None:
    assert guard_slo(BATCH_SLO, URGENT_SLO, 0.5) == Slo(ttft_s=1.5, tbt_s=0.12)
    assert guard_slo(Slo(ttft_s=1.0), URGENT_SLO, 0.5) == Slo(ttft_s=1.0, tbt_s=0.12)  # tighter own; none -> the guard
    assert guard_slo(BATCH_SLO, Slo(), 0.5) == BATCH_SLO  # an urgent class without SLOs guards nothing
    assert guarded(of("interactive"), RULES).slo == URGENT_SLO  # the most urgent class: its own
    assert guarded(of("batch"), RULES).slo == Slo(ttft_s=1.5, tbt_s=0.12)
    assert guarded(of("batch"), ClassRules()).slo == BATCH_SLO  # no classes told: unchanged


def test_a_batch_request_that_would_slow_urgent_streams_is_rejected_and_an_urgent_one_admitted() -> None:
    urgent = scaled(40, 0.8)  # one more stream: within the urgent TBT, past half of it
    rules = replace(RULES, urgent_slo=urgent)
    batch_slo = Slo(ttft_s=60.0, tbt_s=4 * urgent.tbt_s)  # type: ignore[operator]
    cluster = busy(40)
    batch = routed(policy(rules), of("batch", slo=batch_slo), cluster)
    assert batch.rejected and batch.rejection is not None and batch.rejection.reason == "tbt_slo"
    assert not routed(policy(rules), of("interactive", slo=urgent), cluster).rejected
    assert not routed(policy(None), of("batch", slo=batch_slo), cluster).rejected  # class-blind: its own TBT admits it


def test_a_batch_request_is_admitted_where_the_urgent_class_keeps_room() -> None:
    urgent = scaled(40, 0.4)  # one more stream: within half the urgent TBT
    batch_slo = Slo(ttft_s=60.0, tbt_s=4 * urgent.tbt_s)  # type: ignore[operator]
    assert not routed(policy(replace(RULES, urgent_slo=urgent)), of("batch", slo=batch_slo), busy(40)).rejected


# ---- tenants' share of the work ---------------------------------------------------------------------


def test_over_share_flooding_and_work() -> None:
    assert work(of("batch", prompt=1000)) == 1000 + 2 * 128
    assert not over_share(50.0, 100.0, 1.0, 2.0) and over_share(51.0, 100.0, 1.0, 2.0)
    assert not over_share(60.0, 100.0, 2.0, 3.0)  # twice the weight: two thirds
    assert not flooding(290.0, 1.0, 100.0, 1.0) and flooding(310.0, 1.0, 100.0, 1.0)  # FLOOD = 3
    assert not flooding(500.0, 2.0, 100.0, 1.0)  # per weight: 250 against 100


def _admitted() -> Decision:
    d = routed(policy(), of("batch", "A", prompt=100), busy(1))
    assert not d.rejected
    return d


def _missed() -> Decision:
    """An SLO rejection: a prompt no worker prefills within the TTFT SLO."""
    d = routed(policy(), of("interactive", "A", prompt=200_000), busy(1))
    assert d.rejection is not None and d.rejection.reason == "ttft_slo"
    return d


def _flood(t: TenantService, at: float = 100.0, b_requests: int = 20, a_requests: int = 2) -> None:
    """B sends `b_requests` and A `a_requests` (all admitted) just before `at`."""
    ok = _admitted()
    for i in range(b_requests):
        t.record(of("batch", "B", rid=f"b{i}"), ok, at - 1.0)
    for i in range(a_requests):
        t.record(of("batch", "A", rid=f"a{i}"), ok, at - 1.0)


def test_a_flooding_tenant_is_refused_before_another_tenant_is() -> None:
    t = TenantService(RULES)
    _flood(t)
    assert t.refuse(of("batch", "B"), 100.0) is None  # the fleet has room: nothing refused, nothing near
    t.record(of("batch", "B", rid="late"), _missed(), 100.0)  # B's own request refused for room
    d = t.refuse(of("batch", "B"), 100.0)
    assert d is not None and d.reason == TENANT_SHARE and "'A'" in d.message and d.retry_after_s > 0
    assert t.refuse(of("batch", "A"), 100.0) is None  # A sends within its share
    # B's urgent requests too: its whole service is weighed, not its urgent work alone
    assert t.refuse(of("interactive", "B"), 100.0) is not None
    # once the fleet refused nobody for CONTEND_S (and the request is not near its SLO), B is admitted
    assert t.refuse(of("batch", "B"), 100.0 + CONTEND_S + 0.1, ttft_s=0.1) is None


def test_a_flooding_tenant_is_refused_when_its_request_is_near_its_slo() -> None:
    t = TenantService(RULES)
    _flood(t)
    judged = guarded(of("batch", "B"), RULES)  # as the policy asks: by the SLO admission judges it by
    slo = judged.slo.ttft_s
    assert slo is not None
    assert t.refuse(judged, 100.0, ttft_s=0.9 * NEAR * slo) is None
    assert t.refuse(judged, 100.0, ttft_s=1.1 * NEAR * slo) is not None


def test_tenants_within_share_or_alone_are_never_refused_for_share() -> None:
    missed = _missed()
    alone = TenantService(RULES)
    _flood(alone, a_requests=0)
    alone.record(of("batch", "B", rid="late"), missed, 100.0)
    assert alone.refuse(of("batch", "B"), 100.0) is None  # A sent nothing: B may use everything
    # A sent its last request ACTIVE_S ago: not a contender any more
    assert alone.refuse(of("batch", "B"), 100.0 + ACTIVE_S) is None
    even = TenantService(RULES)  # the same demand, B admitted more: noise, not a flood
    _flood(even, b_requests=3, a_requests=1)
    even.record(of("batch", "A", rid="a-late"), missed, 100.0)
    even.record(of("batch", "A", rid="a-late2"), missed, 100.0)
    assert even.refuse(of("batch", "B"), 100.0) is None


def test_a_share_rejection_is_not_a_shortage_of_room_and_the_work_decays() -> None:
    t = TenantService(RULES)
    _flood(t)
    share = replace(_admitted(), rejection=Rejection(reason=TENANT_SHARE, message="over its share"))
    t.record(of("batch", "B", rid="b-share"), share, 100.0)
    assert t.refuse(of("batch", "B"), 100.0) is None
    t.record(of("batch", "B", rid="late"), _missed(), 100.0)
    assert t.refuse(of("batch", "B"), 100.0) is not None
    # 30 s on, A's new work counts in full, B's old work decayed to an eighth: within its share
    for i in range(2):
        t.record(of("batch", "A", rid=f"a-new{i}"), _admitted(), 130.0)
    t.record(of("batch", "B", rid="late2"), _missed(), 130.0)
    assert t.refuse(of("batch", "B"), 130.0) is None


def test_a_flooding_tenant_is_refused_where_streams_decode_before_anyone_is_refused() -> None:
    t = TenantService(RULES)
    _flood(t)
    assert t.refuse(of("batch", "B"), 100.0, ttft_s=0.1) is None  # an idle worker takes it: room
    d = t.refuse(of("batch", "B"), 100.0, ttft_s=0.1, busy=True)  # a worker with streams: A's room
    assert d is not None and d.reason == TENANT_SHARE and "decoding streams" in d.message
    assert t.refuse(of("interactive", "B"), 100.0, ttft_s=0.1, busy=True) is not None
    assert t.refuse(of("batch", "A"), 100.0, ttft_s=0.1, busy=True) is None  # A within its share
    assert t.refuse(of("batch", "B"), 100.0 + ACTIVE_S, ttft_s=0.1, busy=True) is None  # A gone quiet: B alone


def test_the_first_few_requests_of_an_even_load_are_no_flood() -> None:
    t = TenantService(RULES)
    _flood(t, b_requests=4, a_requests=1)  # 4x A's work, but a handful of requests: noise
    assert FLOOD < 4 <= FLOOD * (1 + EVIDENCE)
    assert t.refuse(of("batch", "B"), 100.0, busy=True) is None
    _flood(t, b_requests=16, a_requests=1)  # 20 against 2: a flood, however few A sent
    assert t.refuse(of("batch", "B"), 100.0, busy=True) is not None


def _steady(t: TenantService, a_every_s: float, a_refused: float = 0.0, b_admitted: float = 1.0) -> None:
    """40 s of B sending 10 requests a second (a flood), a share `b_admitted` of them admitted and the
    rest refused for room, and A one every `a_every_s`, a share `a_refused` of them refused for room."""
    ok, missed = _admitted(), _missed()
    a_next, a_sent, a_done, b_done = 0.0, 0, 0.0, 0.0
    for i in range(400):
        now = i * 0.1
        b_done += b_admitted
        t.record(of("batch", "B", rid=f"b{i}"), ok if b_done >= 1.0 else missed, now)
        b_done -= 1.0 if b_done >= 1.0 else 0.0
        if now >= a_next:
            a_sent, a_done = a_sent + 1, a_done + a_refused
            t.record(of("batch", "A", rid=f"a{i}"), missed if a_done >= 1.0 else ok, now)
            a_done -= 1.0 if a_done >= 1.0 else 0.0
            a_next += a_every_s


def test_a_trickle_beside_a_flood_leaves_the_flooder_the_room_it_does_not_use() -> None:
    t = TenantService(RULES)
    _steady(t, a_every_s=4.0, b_admitted=0.5)  # A at a 40th of B's rate, all of it served
    t.record(of("batch", "B", rid="late"), _missed(), 40.0)  # the fleet refusing for room
    # A is a contender (sent within ACTIVE_S), B floods and is over its share of the service, but
    # max-min: A has all it asked for, the rest is B's to take
    assert t.refuse(of("batch", "B"), 40.0, ttft_s=10.0, busy=True) is None
    # A's trickle refused for room: short of what it asked, by less than SLACK of the service
    refused = TenantService(RULES)
    _steady(refused, a_every_s=4.0, a_refused=1.0, b_admitted=0.5)
    assert refused.refuse(of("batch", "B"), 40.0, busy=True) is None
    # a trickle's rate is known by its demand over the window: a sending period as young as a flood's
    # start would make the same requests a rate of the whole part (`wants`), and B refused
    young = TenantService(RULES)
    _steady(young, a_every_s=4.0, b_admitted=0.5)
    young._since["A"] = 39.0  # as if A had started sending a second ago
    assert young.refuse(of("batch", "B"), 40.0, busy=True) is not None


def test_a_flood_is_refused_where_the_other_tenant_wants_its_share_or_is_short_of_it() -> None:
    t = TenantService(RULES)  # A at 3 req/s, a third refused; B at 10x its share, a quarter admitted
    _steady(t, a_every_s=1 / 3, a_refused=1 / 3, b_admitted=0.25)
    assert t.refuse(of("batch", "B"), 40.0, busy=True) is not None
    assert t.refuse(of("batch", "A"), 40.0, busy=True) is None
    # A at 1 req/s, under its part of the service (B has 4 req/s of it) but nearly all refused: short
    # of what it asked by more than SLACK of the service
    short = TenantService(RULES)
    _steady(short, a_every_s=1.0, a_refused=0.9, b_admitted=0.4)
    assert short.refuse(of("batch", "B"), 40.0, busy=True) is not None
    # the same A, all served: B over its share of the service keeps what A does not use
    served = TenantService(RULES)
    _steady(served, a_every_s=1.0, b_admitted=0.4)
    assert served.refuse(of("batch", "B"), 40.0, busy=True) is None


def test_the_policy_holds_a_flooder_off_busy_workers_and_admits_it_on_an_idle_one() -> None:
    p = policy()
    idle = ClusterSnapshot(99.0, (InstanceView("m0", Role.MIXED),))
    for i in range(30):
        assert not routed(p, of("batch", "B", rid=f"b{i}"), idle).rejected
    for i in range(3):  # A sends a few in the second
        assert not routed(p, of("batch", "A", rid=f"a{i}"), idle).rejected
    # nobody refused, nothing near its SLO: B is held off the workers with streams, not off an idle one
    d = routed(p, of("batch", "B", prompt=100, rid="b-busy"), busy(1))
    assert d.rejection is not None and d.rejection.reason == TENANT_SHARE
    assert not routed(p, of("batch", "A", prompt=100, rid="a-busy"), busy(1)).rejected
    assert not routed(p, of("batch", "B", prompt=100, rid="b-idle"), ClusterSnapshot(100.0, idle.instances)).rejected


def test_the_policy_refuses_a_flooding_tenant_and_admits_the_other() -> None:
    p = policy()
    idle = ClusterSnapshot(99.0, (InstanceView("m0", Role.MIXED),))
    for i in range(30):
        assert not routed(p, of("batch", "B", rid=f"b{i}"), idle).rejected
    for i in range(3):
        assert not routed(p, of("batch", "A", rid=f"a{i}"), idle).rejected
    missed = routed(p, of("interactive", "B", prompt=200_000, rid="b-big"), busy(1))
    assert missed.rejection is not None and missed.rejection.reason == "ttft_slo"
    d = routed(p, of("batch", "B", prompt=100, rid="b9"), busy(1))
    assert d.rejection is not None and d.rejection.reason == TENANT_SHARE
    assert not routed(p, of("batch", "A", prompt=100, rid="a9"), busy(1)).rejected


def test_without_tenants_told_a_flood_is_not_refused_for_share() -> None:
    p = policy(ClassRules(ranks=RULES.ranks, sheddable=RULES.sheddable, urgent_slo=URGENT_SLO))
    assert p.tenants is None
    idle = ClusterSnapshot(99.0, (InstanceView("m0", Role.MIXED),))
    for i in range(6):
        assert not routed(p, of("batch", "B", rid=f"b{i}"), idle).rejected
    assert not routed(p, of("batch", "A", rid="a0"), idle).rejected
    assert routed(p, of("interactive", "B", prompt=200_000, rid="b-big"), busy(1)).rejected
    assert not routed(p, of("batch", "B", prompt=100, rid="b9"), busy(1)).rejected


# ---- the gateway tells the policy -------------------------------------------------------------------


def test_the_gateway_tells_kvcache_aware_its_classes_and_tenants() -> None:
    classes = {
        "interactive": {"slo": {"ttft_s": 3.0, "tbt_s": 0.24}, "rank": 0},
        "batch": {"slo": {"ttft_s": 60.0, "tbt_s": 0.9}, "rank": 1, "sheddable": True},
    }
    tenants = {"A": {"api_keys": ["sk-a"]}, "B": {"api_keys": ["sk-b"], "weight": 2}}
    s = load_settings(
        environ={},
        overrides={
            "mixed": ["http://m:1"],
            "slo": {"ttft_s": 9.0, "tbt_s": 0.5},
            "priority": {"classes": classes, "default": "interactive", "guard_margin": 0.4},
            "auth": {"tenants": tenants},
        },
    )
    p = Gateway(s).policy
    assert isinstance(p, KvCacheAwarePolicy)
    rules = p.classes
    assert rules.urgent_slo == URGENT_SLO and rules.guard_margin == 0.4
    assert rules.sheddable == {"batch"} and dict(rules.weights) == {"A": 1.0, "B": 2.0}
    assert p.tenants is not None
    plain = Gateway(load_settings(environ={}, overrides={"mixed": ["http://m:1"]})).policy
    assert isinstance(plain, KvCacheAwarePolicy) and plain.classes == ClassRules() and plain.tenants is None


# ---- mixed workers' prefill duty --------------------------------------------------------------------


def test_prefill_duty_stretches_and_forgets() -> None:
    duty = PrefillDuty()
    assert duty.stretch("m0", 2.0, 100.0) == pytest.approx(1 / (1 - 2.0 / WINDOW_S))
    admitted = routed(policy(), of("interactive"), busy(1))
    assert admitted.prefill is not None and not admitted.rejected
    seconds = next(c.detail["prefill_s"] for c in admitted.candidates if c.instance_id == admitted.prefill)
    duty.record(admitted, 100.0 - 2 * WINDOW_S)  # the policy's first decision, a whole window before
    for _ in range(3):
        duty.record(admitted, 100.0)
    assert duty.stretch(admitted.prefill, 0.0, 100.0) == pytest.approx(1 / (1 - 3 * seconds / WINDOW_S))
    assert duty.stretch("other", 0.0, 100.0) == 1.0
    assert duty.stretch(admitted.prefill, 0.0, 100.0 + WINDOW_S + 1) == 1.0  # out of the window, before pruning
    duty.record(admitted, 100.0 + WINDOW_S + 1)  # pruned: only the new one
    assert duty.stretch(admitted.prefill, 0.0, 100.0 + WINDOW_S + 1) == pytest.approx(1 / (1 - seconds / WINDOW_S))


def test_a_young_policys_duty_is_over_the_time_it_has_seen() -> None:
    admitted = routed(policy(), of("interactive"), busy(1))
    assert admitted.prefill is not None and not admitted.rejected
    seconds = next(c.detail["prefill_s"] for c in admitted.candidates if c.instance_id == admitted.prefill)
    duty = PrefillDuty()
    duty.record(admitted, 100.0)  # its first decision
    duty.record(admitted, 100.0)
    # half a second in: over MIN_SPAN_S, not the whole window (an idle past assumed) nor 0.5 s
    assert duty.stretch(admitted.prefill, 0.0, 100.5) == pytest.approx(1 / (1 - 2 * seconds / MIN_SPAN_S))
    span = MIN_SPAN_S + 2.0  # past MIN_SPAN_S: over the seconds seen
    assert duty.stretch(admitted.prefill, 0.0, 100.0 + span) == pytest.approx(1 / (1 - 2 * seconds / span))


def test_a_batch_request_is_rejected_where_urgent_prefills_keep_the_workers_busy() -> None:
    urgent = scaled(40, 0.4)  # by its TBT alone, a batch request fits (the test above)
    rules = replace(RULES, urgent_slo=urgent)
    batch_slo = Slo(ttft_s=60.0, tbt_s=4 * urgent.tbt_s)  # type: ignore[operator]
    p, cluster = policy(rules), ClusterSnapshot(100.0, busy(40).instances[:1])  # one worker: they all go there
    roomy = Slo(ttft_s=1e6, tbt_s=1.0)
    assert not policy(rules).decide(of("batch", slo=batch_slo), cluster).rejected
    for i in range(6):  # urgent requests with long prompts admitted: their prefills fill the window
        assert not routed(p, of("interactive", prompt=32_000, rid=f"u{i}", slo=roomy), cluster).rejected
    d = routed(p, of("batch", slo=batch_slo), cluster)
    assert d.rejection is not None and d.rejection.reason == "tbt_slo"
    assert not routed(p, of("interactive", slo=urgent), cluster).rejected  # the urgent class is what the room is for


def test_a_batch_prefill_counts_the_prefills_queued_ahead_of_it_against_the_streams() -> None:
    # 10 streams near their end, a long prefill queued: a small batch prompt alone would be absorbed,
    # but the streams sit through the queue ahead of it too
    streams = tuple(ActiveDecode(4000, 4) for _ in range(10))
    worker = InstanceView("m0", Role.MIXED, decodes=streams, prefill_queue=(QueuedPrefill(30_000, 0, 0.0),))
    cluster = ClusterSnapshot(100.0, (worker,))
    urgent = Slo(ttft_s=1e3, tbt_s=20 * predictors().tbt_s(11, 1024 + 128 + 10 * 4000))
    batch = of("batch", slo=urgent)
    d = policy(replace(RULES, urgent_slo=urgent)).decide(batch, cluster)
    assert d.rejection is not None and d.rejection.reason == "tbt_slo" and "pause" in d.rejection.message
    assert not policy(None).decide(batch, cluster).rejected
