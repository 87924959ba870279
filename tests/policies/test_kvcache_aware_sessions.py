"""kvcache_aware's session affinity (policies/kvcache_aware/sessions.py): a session's turns and an agent's
parallel calls stay on the instances that served it while their predictions are within the slacks and the
SLO, the session moves when its instance would miss the SLO, and the policy's memory of sessions is bounded."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conductor.core.types import Decision, RequestView, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.kvcache_aware.sessions import DETAIL, KEPT, MOVED, SessionTable
from predictors import OnlineConfig, PredictorParams, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import decode, prefill, request, routed, snapshot

SLO = Slo(ttft_s=10.0, tbt_s=0.2)


@pytest.fixture(scope="module")
def params() -> PredictorParams:
    return fit_profiles([bundled_profile()])


def policy(params: PredictorParams, **kw: object) -> KvCacheAwarePolicy:
    return KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig(enabled=False)), **kw)  # type: ignore[arg-type]


def turn(rid: str, session: int | None, prompt: int = 4000, slo: Slo = SLO) -> RequestView:
    return replace(request(prompt, slo=slo, rid=rid), session=session)


def marks(decision: Decision) -> dict[str, float]:
    return {c.instance_id: c.detail[DETAIL] for c in decision.candidates if DETAIL in c.detail}


def test_a_sessions_next_turn_stays_on_its_instances_within_the_slack(params: PredictorParams) -> None:
    p = policy(params)
    idle = snapshot(prefill("p0"), prefill("p1"), decode("d0"), decode("d1"))
    first = routed(p, turn("a1", 7), idle)
    assert (first.prefill, first.decode) == ("p0", "d0") and not marks(first)  # a first turn: nothing to follow
    # p0 now has one short prefill queued, d0 one stream: the policy alone would pick p1 and d1
    busy = snapshot(prefill("p0", queued=1, tokens=2000), prefill("p1"), decode("d0", streams=1), decode("d1"))
    plain = routed(policy(params), turn("x", None), busy)
    assert (plain.prefill, plain.decode) == ("p1", "d1")
    second = routed(p, turn("a2", 7), busy)
    assert (second.prefill, second.decode) == ("p0", "d0")
    assert marks(second) == {"p0": KEPT, "d0": KEPT}  # the decision log shows affinity chose them
    # another session, or no session, is placed as before
    assert routed(p, turn("b1", 8), busy).prefill == "p1"
    assert routed(p, turn("c1", None), busy).prefill == "p1"
    assert p.sessions is not None and p.sessions.last(7) == ("p0", "d0") and p.sessions.last(8) == ("p1", "d1")


def test_an_agents_parallel_calls_land_together(params: PredictorParams) -> None:
    p, q = policy(params), policy(params, session_affinity=False)
    for pol in (p, q):
        queue: list[str] = []
        for n in range(3):  # each call's prefill queued where it went, as the gateway's snapshot shows it
            cluster = snapshot(
                prefill("p0", queued=queue.count("p0"), tokens=3000),
                prefill("p1", queued=queue.count("p1"), tokens=3000),
                decode("d0"),
            )
            queue.append(routed(pol, turn(f"call{n}", 42, prompt=3000), cluster).prefill or "")
        if pol is p:
            assert queue == ["p0", "p0", "p0"]
        else:
            assert queue == ["p0", "p1", "p0"]  # without affinity they spread over the queues


def test_a_session_moves_when_its_instance_would_miss_the_slo(params: PredictorParams) -> None:
    # a slack as wide as the SLO: only admission's verdict on the session's instance can move it
    p = policy(params, session_slack=1.0)
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    jammed = snapshot(prefill("p0", queued=48, tokens=8000), prefill("p1"), decode("d0"))
    alone = routed(policy(params), turn("z", None), snapshot(prefill("p0", queued=48, tokens=8000), decode("d0")))
    assert alone.rejection is not None and alone.rejection.reason == "ttft_slo"  # p0 would miss the TTFT SLO
    moved = routed(p, turn("a2", 7), jammed)
    assert moved.rejection is None and moved.prefill == "p1" and marks(moved)["p1"] == MOVED
    assert p.sessions is not None and p.sessions.last(7) == ("p1", "d0")  # and it stays there
    back = snapshot(prefill("p0"), prefill("p1", queued=1, tokens=2000), decode("d0"))
    assert routed(p, turn("a3", 7), back).prefill == "p1"


def test_a_session_moves_when_its_instance_is_slower_than_the_slack(params: PredictorParams) -> None:
    p = policy(params)  # session_slack 0.25: 2.5 s of the 10 s SLO
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    slower = routed(p, turn("a2", 7), snapshot(prefill("p0", queued=20, tokens=8000), prefill("p1"), decode("d0")))
    assert slower.prefill == "p1" and marks(slower)["p1"] == MOVED
    tight = policy(params, session_slack=0.0)  # slack 0: kept only where the policy would choose it anyway
    routed(tight, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    assert (
        routed(tight, turn("a2", 7), snapshot(prefill("p0", queued=1, tokens=2000), prefill("p1"), decode("d0"))).prefill == "p1"
    )


def test_a_session_whose_instance_left_moves(params: PredictorParams) -> None:
    p = policy(params)
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    gone = routed(p, turn("a2", 7), snapshot(prefill("p1"), decode("d0")))
    assert gone.prefill == "p1" and marks(gone)["p1"] == MOVED


def test_a_rejected_turn_is_not_remembered(params: PredictorParams) -> None:
    p = policy(params, probe_after=None)
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    hopeless = turn("a2", 7, prompt=30000, slo=Slo(ttft_s=0.001))
    assert routed(p, hopeless, snapshot(prefill("p0"), prefill("p1", queued=0), decode("d0"))).rejection is not None
    assert p.sessions is not None and p.sessions.last(7) == ("p0", "d0")


def test_the_session_table_is_bounded_least_recent_out_first(params: PredictorParams) -> None:
    table = SessionTable(3)
    for s in range(5):
        table.remember(turn(f"r{s}", s), Decision(f"r{s}", "kvcache_aware", prefill="p0", decode="d0"))
    table.remember(turn("again", 2), Decision("again", "kvcache_aware", prefill="p1", decode="d0"))  # 2 used last
    table.remember(turn("new", 9), Decision("new", "kvcache_aware", prefill="p0", decode="d0"))
    assert len(table) == 3 and [table.last(s) is not None for s in (0, 1, 2, 3, 4, 9)] == [False, False, True, False, True, True]
    p = policy(params, max_sessions=2)
    cluster = snapshot(prefill("p0"), prefill("p1"), decode("d0"))
    for s in range(10):
        routed(p, turn(f"s{s}", s), cluster)
    assert p.sessions is not None and len(p.sessions) == 2
    with pytest.raises(ValueError, match="max_sessions"):
        SessionTable(0)


def test_affinity_off_reads_no_session(params: PredictorParams) -> None:
    p = policy(params, session_affinity=False)
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    busy = snapshot(prefill("p0", queued=1, tokens=2000), prefill("p1"), decode("d0"))
    decision = routed(p, turn("a2", 7), busy)
    assert decision.prefill == "p1" and not marks(decision) and p.sessions is None
