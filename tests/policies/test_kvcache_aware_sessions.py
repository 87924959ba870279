"""kvcache_aware's sessions (policies/kvcache_aware/sessions.py): where the KV index is blind, the prefix a
session's last turn left on its prefill enters the cost model as a hint (and an agent's parallel calls land
together); where the index knows, a session changes nothing; the session's decode is preferred only where a
readback of the last turn is offered from it; the policy's memory of sessions is bounded."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conductor.core.types import CachedPrefix, Decision, RequestView, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.kvcache_aware.sessions import AGREED, DECIDED, DETAIL, HINT, KEPT, MOVED, SAMPLED_KEYS, LastTurn, SessionTable
from predictors import OnlineConfig, PredictorParams, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import decode, prefill, request, routed, snapshot

SLO = Slo(ttft_s=10.0, tbt_s=0.2)


@pytest.fixture(scope="module")
def params() -> PredictorParams:
    return fit_profiles([bundled_profile()])


def policy(params: PredictorParams, **kw: object) -> KvCacheAwarePolicy:
    return KvCacheAwarePolicy(predictors=Predictors(params, OnlineConfig(enabled=False)), **kw)


def turn(rid: str, session: int | None, prompt: int = 4000, slo: Slo = SLO, **kw: object) -> RequestView:
    return replace(request(prompt, slo=slo, rid=rid), session=session, **kw)  # type: ignore[arg-type]


def marks(decision: Decision, key: str = HINT) -> dict[str, float]:
    return {c.instance_id: c.detail[key] for c in decision.candidates if key in c.detail}


def keys(n: int, first: int = 1) -> tuple[int, ...]:
    return tuple(range(first, first + n))


IDLE = snapshot(prefill("p0"), prefill("p1"), decode("d0"), decode("d1"))
# p0 has one prefill queued: a session-less request goes to p1
BUSY = snapshot(prefill("p0", queued=1, tokens=2000), prefill("p1"), decode("d0"), decode("d1"))


def test_a_blind_index_gets_the_sessions_prefix_as_a_hint_that_decides(params: PredictorParams) -> None:
    p = policy(params)
    first = routed(p, turn("a1", 7), IDLE)
    assert (first.prefill, first.decode) == ("p0", "d0") and not marks(first)  # a first turn: nothing to follow
    assert routed(policy(params), turn("x", None, prompt=6000), BUSY).prefill == "p1"
    second = routed(p, turn("a2", 7, prompt=6000), BUSY)  # the index reports nothing: 4000 tokens hinted on p0
    assert second.prefill == "p0" and marks(second) == {"p0": DECIDED}
    p0 = next(c for c in second.candidates if c.instance_id == "p0")
    assert p0.detail["cached_tokens"] == 4000  # the hint is in the estimate: the decision shows what it assumed
    assert not marks(second, DETAIL)  # no readback offered: the decode is not biased
    # another session, or no session, is placed as before
    assert routed(p, turn("b1", 8, prompt=6000), BUSY).prefill == "p1"
    assert routed(p, turn("c1", None, prompt=6000), BUSY).prefill == "p1"
    last = p.sessions.last(7) if p.sessions is not None else None
    assert last is not None and (last.prefill, last.prompt_tokens) == ("p0", 6000)


def test_no_hint_where_the_index_already_reports_the_prefix(params: PredictorParams) -> None:
    p = policy(params, inflight_prefixes=False)  # only the index reports prefixes here
    routed(p, turn("a1", 7, block_keys=keys(250)), IDLE)  # 4000 tokens: 250 blocks of 16
    known = {"p0": CachedPrefix(4000)}
    tagged = routed(p, turn("a2", 7, prompt=6000, block_keys=keys(375), cached=known), BUSY)
    untagged = routed(policy(params), turn("a2", None, prompt=6000, block_keys=keys(375), cached=known), BUSY)
    assert not marks(tagged) and (tagged.prefill, tagged.predicted_ttft_s) == (untagged.prefill, untagged.predicted_ttft_s)
    assert p.sessions is not None and p.sessions.counts["unhinted"] == 1
    # a prompt whose start changed shares no block with the last turn: nothing there to reuse, no hint
    changed = routed(p, turn("a3", 7, prompt=6000, block_keys=keys(375, first=1000)), BUSY)
    assert changed.prefill == "p1" and not marks(changed)
    # the index reports less than the turn left (its entry evicted, its events late): hinted up to what is shared
    routed(p, turn("a4", 7, block_keys=keys(250)), IDLE)
    late = routed(p, turn("a5", 7, prompt=6000, block_keys=keys(375), cached={"p0": CachedPrefix(512)}), BUSY)
    assert late.prefill == "p0" and marks(late) == {"p0": DECIDED}


def test_no_hint_where_the_in_flight_table_holds_the_last_turn(params: PredictorParams) -> None:
    p = policy(params)
    routed(p, turn("a1", 7, block_keys=keys(250)), IDLE)  # dispatched to p0, not yet observed
    follow = routed(p, turn("a2", 7, prompt=6000, block_keys=keys(375)), BUSY)
    assert follow.prefill == "p0" and not marks(follow)  # the in-flight table already credits p0
    assert p.sessions is not None and p.sessions.counts["unhinted"] == 1


def test_the_shared_prefix_is_read_from_the_sampled_block_keys() -> None:
    last = LastTurn.of(turn("a", 1, prompt=1600, block_keys=keys(100)), Decision("a", "kvcache_aware", prefill="p0"))
    assert last.keys is not None and len(last.keys) == SAMPLED_KEYS
    assert last.shared_tokens(turn("b", 1, prompt=3200, block_keys=keys(200))) == 1600  # the whole last turn
    half = last.shared_tokens(turn("c", 1, prompt=3200, block_keys=(*keys(50), *keys(150, first=500))))
    assert 50 * 16 - 100 // SAMPLED_KEYS * 16 <= half <= 50 * 16  # at most a sampling step short, never over
    assert last.shared_tokens(turn("d", 1, prompt=800, block_keys=keys(50))) == 800  # a shorter prompt: all of it
    unkeyed = LastTurn.of(turn("e", 1, prompt=1000), Decision("e", "kvcache_aware", prefill="p0"))
    assert unkeyed.keys is None and unkeyed.shared_tokens(turn("f", 1, prompt=3000)) == 992  # whole blocks


def test_an_agents_parallel_calls_land_together_when_the_index_is_blind(params: PredictorParams) -> None:
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
            assert queue == ["p0", "p1", "p0"]  # without the hint they spread over the queues


def test_a_session_moves_when_its_instance_would_miss_the_slo(params: PredictorParams) -> None:
    p = policy(params)
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    jammed = snapshot(prefill("p0", queued=48, tokens=8000), prefill("p1"), decode("d0"))
    alone = routed(policy(params), turn("z", None), snapshot(prefill("p0", queued=48, tokens=8000), decode("d0")))
    assert alone.rejection is not None and alone.rejection.reason == "ttft_slo"  # p0 would miss the TTFT SLO
    moved = routed(p, turn("a2", 7), jammed)
    assert moved.rejection is None and moved.prefill == "p1" and marks(moved) == {"p1": MOVED}
    last = p.sessions.last(7) if p.sessions is not None else None
    assert last is not None and last.prefill == "p1"  # and it is hinted there next
    back = snapshot(prefill("p0"), prefill("p1", queued=1, tokens=2000), decode("d0"))
    assert routed(p, turn("a3", 7), back).prefill == "p1"


def test_the_hint_agrees_where_the_policy_would_choose_the_instance_anyway(params: PredictorParams) -> None:
    p = policy(params)
    routed(p, turn("a1", 7), IDLE)
    again = routed(p, turn("a2", 7, prompt=6000), IDLE)
    assert again.prefill == "p0" and marks(again) == {"p0": AGREED}
    assert p.sessions is not None and p.sessions.counts["prefill_agreed"] == 1 and p.sessions.counts["first"] == 1


def test_a_session_whose_instance_left_gets_no_hint(params: PredictorParams) -> None:
    p = policy(params)
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    gone = routed(p, turn("a2", 7), snapshot(prefill("p1"), decode("d0")))
    assert gone.prefill == "p1" and not marks(gone)


def test_the_sessions_decode_is_kept_only_where_a_readback_is_offered_from_it(params: PredictorParams) -> None:
    p = policy(params)
    routed(p, turn("a1", 7), IDLE)  # on p0 and d0
    loaded = snapshot(prefill("p0"), prefill("p1"), decode("d0", streams=1), decode("d1"))
    plain = routed(p, turn("a2", 7, prompt=6000), loaded)
    assert plain.decode == "d1" and not marks(plain, DETAIL)  # no readback: the least loaded decode, no bias
    routed(p, turn("a3", 7), IDLE)  # back on d0
    readback = routed(p, turn("a4", 7, prompt=6000, pull_sources={"d0": 4000}), loaded)
    assert readback.decode == "d0" and marks(readback, DETAIL) == {"d0": KEPT}
    routed(p, turn("a5", 7), IDLE)
    far = snapshot(prefill("p0"), prefill("p1"), decode("d0", streams=40), decode("d1"))
    beyond = routed(p, turn("a6", 7, prompt=6000, pull_sources={"d0": 4000}), far)  # loaded past the slack
    assert beyond.decode == "d1" and marks(beyond, DETAIL) == {"d1": MOVED}


def test_a_rejected_turn_is_not_remembered(params: PredictorParams) -> None:
    p = policy(params, probe_after=None)
    routed(p, turn("a1", 7), snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    hopeless = turn("a2", 7, prompt=30000, slo=Slo(ttft_s=0.001))
    assert routed(p, hopeless, snapshot(prefill("p0"), prefill("p1", queued=0), decode("d0"))).rejection is not None
    last = p.sessions.last(7) if p.sessions is not None else None
    assert last is not None and (last.prefill, last.decode, last.prompt_tokens) == ("p0", "d0", 4000)


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
        routed(p, turn(f"s{s}", s, block_keys=keys(5000)), cluster)  # a long prompt: still SAMPLED_KEYS keys
    assert p.sessions is not None and len(p.sessions) == 2
    last = p.sessions.last(9)
    assert last is not None and last.keys is not None and len(last.keys) == SAMPLED_KEYS
    with pytest.raises(ValueError, match="max_sessions"):
        SessionTable(0)


def test_affinity_off_reads_no_session(params: PredictorParams) -> None:
    p = policy(params, session_affinity=False)
    routed(p, turn("a1", 7), IDLE)
    decision = routed(p, turn("a2", 7, prompt=6000), BUSY)
    assert decision.prefill == "p1" and not marks(decision) and p.sessions is None
