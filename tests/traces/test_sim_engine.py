"""The simulator's mechanics on hand-built traces with the noise off, so times are exact.

The policies here are real Policy objects written for the test (scripted routing that records what
it was shown); the thing under test is the simulator, which runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from conductor.core.types import (
    ClusterSnapshot,
    Decision,
    Observation,
    PrefillLeg,
    Rejection,
    RequestView,
    Slo,
)
from policies.registry import load_policy
from traces.formats import TraceRequest
from traces.sim.cluster import BlockLRU
from traces.sim.config import SimConfig
from traces.sim.engine import Simulator, simulate
from traces.sim.truth import DecodeTruth, fit_truth

Route = Callable[[RequestView, ClusterSnapshot], Decision]


class Scripted:
    """Routes by a function and keeps every view and observation it was given."""

    name = "scripted"

    def __init__(self, route: Route) -> None:
        self.route = route
        self.seen: list[tuple[RequestView, ClusterSnapshot]] = []
        self.observed: list[Observation] = []

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        return self.route(request, cluster)

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        self.seen.append((request, cluster))

    def observe(self, observation: Observation) -> None:
        self.observed.append(observation)


def to(prefill: int, decode: int = 0) -> Route:
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        return Decision(r.request_id, "scripted", prefill=f"prefill-{prefill}", decode=f"decode-{decode}")

    return route


def req(t: float, n: int, out: int, ids: tuple[int, ...], line: int = 1) -> TraceRequest:
    return TraceRequest(arrival_s=t, input_length=n, output_length=out, hash_ids=ids, line=line)


def cfg(p: int = 1, d: int = 1, **kw: object) -> SimConfig:
    base = SimConfig(p, d, truth=fit_truth(), noise=0.0, slo=Slo(ttft_s=5.0, tbt_s=0.1))
    return replace(base, **kw)  # type: ignore[arg-type]


def test_block_lru_prefix_match_and_eviction() -> None:
    lru = BlockLRU(capacity_tokens=3 * 512, block_tokens=512)
    lru.touch((1, 2, 3))
    assert lru.match((1, 2, 3, 4)) == 3
    assert lru.match((2, 3)) == 2 and lru.match((9, 1)) == 0  # a prefix match stops at the first miss
    lru.touch((1,))  # 1 is now the most recent; 2 is the oldest
    lru.touch((7,))
    assert len(lru) == 3 and lru.match((2,)) == 0 and lru.match((1,)) == 1


def test_single_request_times_are_the_truth_model() -> None:
    c = cfg()
    pol = Scripted(to(0))
    res = simulate(pol, [req(0.0, 1000, 11, (1, 2))], c)
    t = c.truth
    tbt = t.decode.tbt_s(1, 1000)  # batch of one, its prompt resident
    expected_ttft = t.prefill_s(1000, 0) + t.transfer_s(1000) + tbt
    assert res.completed == 1 and res.rejected == 0
    assert res.ttft.mean == pytest.approx(expected_ttft, rel=1e-9)
    assert res.tbt.mean == pytest.approx(tbt, rel=1e-6)
    (obs,) = pol.observed
    assert obs.ttft_s == pytest.approx(expected_ttft)
    assert obs.queue_and_prefill_s == pytest.approx(t.prefill_s(1000, 0))
    # alone on the decode instance: no other stream and no other KV there when it joined
    assert len(obs.token_intervals_s) == 10 and obs.output_tokens == 11 and obs.decode_batch == 0
    assert obs.decode_resident_kv_tokens == 0
    assert res.slo_met == 1 and res.goodput_rps > 0


def test_local_prefix_reuse_and_what_the_policy_sees() -> None:
    pol = Scripted(to(0))
    trace = [req(0.0, 1024, 2, (5, 6)), req(10.0, 1500, 2, (5, 6, 7))]
    res = simulate(pol, trace, cfg())
    first_view, second_view = pol.seen[0][0], pol.seen[1][0]
    assert first_view.cached == {} and first_view.block_size == 512 and first_view.block_keys == (5, 6)
    assert second_view.cached["prefill-0"].tokens == 1024  # the index knows prefill-0 holds both blocks
    assert pol.observed[1].cached_tokens == 1024 and pol.observed[1].predicted_cached_tokens == 1024
    assert res.prefix_hit_local == pytest.approx(1024 / (1024 + 1500))


def test_queue_is_fcfs_and_visible_in_the_snapshot() -> None:
    pol = Scripted(to(0))
    trace = [req(0.0, 30000, 2, (1,), 1), req(0.1, 30000, 2, (2,), 2), req(0.2, 100, 2, (3,), 3)]
    simulate(pol, trace, cfg())
    snap = pol.seen[2][1]
    prefill = next(i for i in snap.instances if i.id == "prefill-0")
    assert [q.new_tokens for q in prefill.prefill_queue] == [30000, 30000]
    assert prefill.prefill_queue[0].elapsed_s == pytest.approx(0.2, abs=0.11)  # views refresh every 0.1 s
    decode = next(i for i in snap.instances if i.id == "decode-0")
    assert len(decode.decodes) == 2  # routed there already, still in prefill
    firsts = [o.ttft_s for o in sorted(pol.observed, key=lambda o: o.request_id)]
    assert firsts[2] is not None and firsts[0] is not None
    assert firsts[2] > firsts[0]  # the short one waited behind both long ones (no overtaking)


def test_pull_from_another_instance_and_from_the_store() -> None:
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq == 0:
            return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")
        if r.seq == 1:
            return Decision(
                r.request_id,
                "s",
                prefill="prefill-1",
                decode="decode-0",
                pull_from="prefill-0",
                pull_tokens=r.cached["prefill-0"].tokens,
            )
        return Decision(
            r.request_id, "s", prefill="prefill-1", decode="decode-0", pull_from="store", pull_tokens=r.store_cached_tokens
        )

    pol = Scripted(route)
    ids = (1, 2, 3)
    trace = [req(0.0, 2000, 2, ids), req(5.0, 2000, 2, (*ids, 9)), req(10.0, 2000, 2, (1, 2, 3, 8))]
    c = cfg(p=3, store_capacity_tokens=100_000)
    res = simulate(pol, trace, c)
    assert pol.seen[1][0].cached["prefill-0"].tokens == 1536
    assert pol.seen[2][0].store_cached_tokens == 1536
    # request 1 pulled 1536 tokens from prefill-0; request 2 found them locally on prefill-1 (the
    # pull replicated them there), so the store pull added nothing beyond the local prefix
    assert pol.observed[1].cached_tokens == 1536
    assert res.prefix_hit_remote == pytest.approx(1536 / 6000)
    assert res.prefix_hit_local == pytest.approx(1536 / 6000)


def test_store_pull_counts_as_store_hit() -> None:
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq == 0:
            return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")
        return Decision(
            r.request_id, "s", prefill="prefill-1", decode="decode-0", pull_from="store", pull_tokens=r.store_cached_tokens
        )

    pol = Scripted(route)
    res = simulate(pol, [req(0.0, 1024, 2, (1, 2)), req(5.0, 1024, 2, (1, 2))], cfg(p=2, store_capacity_tokens=10_000))
    assert res.prefix_hit_store == pytest.approx(1023 / 2048)  # at least one token is always computed
    assert pol.observed[1].cached_tokens == 1023


def test_decode_kv_capacity_makes_requests_wait() -> None:
    small = DecodeTruth(kv_capacity_tokens=1500)
    c = cfg(truth=fit_truth().with_options(decode=small))
    pol = Scripted(to(0))
    simulate(pol, [req(0.0, 1000, 50, (1, 2)), req(0.0, 1000, 50, (3, 4))], c)
    a, b = sorted(pol.observed, key=lambda o: o.request_id)
    first_done = a.ttft_s + sum(a.token_intervals_s)  # type: ignore[operator]
    assert b.ttft_s is not None and b.ttft_s > first_done  # joined only after the first one left
    assert b.decode_batch == 0  # the first one had left: it decoded alone


def test_rejections_are_counted_by_reason_and_not_observed() -> None:
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq % 3 == 1:
            return Decision(r.request_id, "s", rejection=Rejection("ttft_slo", "too slow"))
        if r.seq % 3 == 2:
            return Decision(r.request_id, "s", prefill="nope", decode="decode-0")
        return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")

    pol = Scripted(route)
    res = simulate(pol, [req(i * 1.0, 100, 3, (i,)) for i in range(9)], cfg())
    assert res.rejections == {"ttft_slo": 3, "invalid_decision": 3}
    assert res.rejected == 6 and res.completed == 3 and len(pol.observed) == 3
    assert res.slo_attainment == pytest.approx(3 / 9)


def test_prefill_queue_is_bounded() -> None:
    pol = Scripted(to(0))
    res = simulate(pol, [req(0.0, 8000, 1, (i,)) for i in range(10)], cfg(max_prefill_queue=4))
    assert res.rejections == {"queue_full": 6} and res.completed == 4


def test_noise_is_seeded() -> None:
    trace = [req(i * 0.3, 3000 + 10 * i, 20, (i,)) for i in range(40)]
    runs = [simulate(load_policy("round_robin"), trace, cfg(p=2, d=2, noise=0.1, seed=s)) for s in (1, 1, 2)]
    assert runs[0].ttft == runs[1].ttft
    assert runs[0].ttft != runs[2].ttft


def test_speedup_compresses_arrivals() -> None:
    trace = [req(i * 10.0, 500, 2, (i,)) for i in range(5)]
    slow = simulate(load_policy("round_robin"), trace, cfg())
    fast = simulate(load_policy("round_robin"), trace, cfg(speedup=4.0))
    assert slow.duration_s == pytest.approx(40.0) and fast.duration_s == pytest.approx(10.0)


def test_observe_feeds_the_real_policy_predictors() -> None:
    # kvcache_aware learns from the simulated outcomes: its TBT prediction error is measured
    trace = [req(i * 0.5, 2000 + 100 * (i % 7), 30, (i,)) for i in range(120)]
    pol = load_policy("kvcache_aware", {"admission": "none"})
    sim = Simulator(pol, cfg(p=2, d=2))
    res = sim.run(trace)
    assert res.completed == 120
    assert res.ttft_prediction.count == 120 and res.tbt_prediction.count == 120
    assert res.tbt_prediction.mean_rel < 0.5


def test_recorded_trace_blocks_keep_capacity_in_tokens() -> None:
    # a recorded trace has 16-token blocks: 64 blocks fit in a 1,024-token cache, not 2
    pol = Scripted(to(0))
    keys = tuple(range(1, 61))
    trace = [replace(req(0.0, 960, 2, keys), block_tokens=16), replace(req(5.0, 960, 2, keys), block_tokens=16)]
    res = simulate(pol, trace, cfg(prefill_cache_tokens=1024))
    assert pol.seen[1][0].cached["prefill-0"].tokens == 960 and pol.seen[1][0].block_size == 16
    assert res.prefix_hit_local == pytest.approx(959 / 1920)


def test_a_local_prefill_stalls_the_decode_batch_and_shows_in_its_view() -> None:
    """A decision naming the decode as its prefill too: the prompt is computed there (no prefill
    queue, no KV transfer) while the stream already decoding there waits for it."""
    c = cfg()
    t = c.truth

    def route(r: RequestView, cl: ClusterSnapshot) -> Decision:
        where = "decode-0" if r.request_id == "r1" else "prefill-0"
        return Decision(r.request_id, "scripted", prefill=where, decode="decode-0")

    pol = Scripted(route)
    # r0 decodes 201 tokens through the normal path; r1 is prefilled on the decode at t=1 s
    res = simulate(pol, [req(0.0, 1000, 201, (1,)), req(1.0, 2000, 11, (2,))], c)
    assert res.completed == 2 and res.extra["local_prefills"] == 1
    r0, r1 = sorted(pol.observed, key=lambda o: o.request_id)
    assert r1.prefill == r1.decode == "decode-0"
    # its TTFT: its own prefill on the decode, then one step of the batch of two; no transfer
    step = t.decode.tbt_s(2, 1000 + 2000)
    assert r1.ttft_s is not None and r1.ttft_s == pytest.approx(t.prefill_s(2000, 0) + step, rel=0.02)
    # r0 lost that prefill's time: its mean interval grew by about prefill / its 200 intervals
    alone = t.decode.tbt_s(1, 1000)
    assert sum(r0.token_intervals_s) / len(r0.token_intervals_s) > alone + 0.8 * t.prefill_s(2000, 0) / 200


def test_the_decode_view_lists_a_local_prefill_until_it_is_done() -> None:
    c = cfg()
    seen: list[tuple[str, int]] = []

    def route(r: RequestView, cl: ClusterSnapshot) -> Decision:
        (d,) = [i for i in cl.instances if i.id == "decode-0"]
        seen.append((r.request_id, len(d.prefill_queue)))
        return Decision(r.request_id, "scripted", prefill="decode-0", decode="decode-0")

    prefill_s = c.truth.prefill_s(8000, 0)
    simulate(Scripted(route), [req(0.0, 8000, 3, (1,)), req(prefill_s / 2, 100, 3, (2,)), req(prefill_s * 3, 100, 3, (3,))], c)
    assert seen == [("r0", 0), ("r1", 1), ("r2", 0)]  # r0's prefill runs at r1's arrival, done by r2's


class LegScripted(Scripted):
    """Scripted, and a PrefillLegObserver: keeps each leg, and the order of legs and observations."""

    def __init__(self, route: Route) -> None:
        super().__init__(route)
        self.events: list[tuple[str, str]] = []
        self.legs: list[PrefillLeg] = []

    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        self.legs.append(leg)
        self.events.append(("leg", leg.request_id))

    def observe(self, observation: Observation) -> None:
        super().observe(observation)
        self.events.append(("observation", observation.request_id))


def test_a_leg_observer_is_told_each_prefill_leg_as_it_ends() -> None:
    """The second request queues behind the first; both legs are told before either request's
    decode is over (the gateway tells them when the NIXL prefill answers), with the figures its
    Observation repeats."""
    pol = LegScripted(to(0))
    trace = [req(0.0, 4000, 40, (1,), 1), req(0.01, 2000, 40, (2,), 2)]
    simulate(pol, trace, cfg())
    assert [kind for kind, _ in pol.events] == ["leg", "leg", "observation", "observation"]
    by_id = {o.request_id: o for o in pol.observed}
    t = cfg().truth
    first, second = pol.legs
    assert first.queue_and_prefill_s == pytest.approx(t.prefill_s(4000, 0))
    assert second.queue_and_prefill_s == pytest.approx(t.prefill_s(4000, 0) + t.prefill_s(2000, 0) - 0.01)
    for leg in pol.legs:
        obs = by_id[leg.request_id]
        assert (leg.prefill, leg.prompt_tokens, leg.cached_tokens) == ("prefill-0", obs.prompt_tokens, obs.cached_tokens)
        assert leg.queue_and_prefill_s == obs.queue_and_prefill_s
    # with observations off (SimConfig.observe), no leg either
    quiet = LegScripted(to(0))
    simulate(quiet, trace, cfg(observe=False))
    assert quiet.events == []


class ClockedLegs(LegScripted):
    """LegScripted that also keeps the simulator's clock when each leg is told."""

    def __init__(self, route: Route) -> None:
        super().__init__(route)
        self.sim: Simulator | None = None
        self.told_at: list[float] = []

    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        super().observe_prefill_leg(leg)
        assert self.sim is not None
        self.told_at.append(self.sim.now)


def test_a_mixed_workers_leg_is_told_at_its_first_token() -> None:
    """As the gateway tells a mixed stream's leg at its first token: at that time (not when its
    prefill is planned), before its decode is over, from arrival, with the TTFT its Observation
    repeats; the worker's cached tokens unknown then (None)."""

    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        return Decision(r.request_id, "scripted", prefill="mixed-0")

    c = SimConfig(0, 1, truth=fit_truth(), noise=0.0, slo=Slo(ttft_s=5.0, tbt_s=0.1), mixed=True, pull="none")
    pol = ClockedLegs(route)
    sim = pol.sim = Simulator(pol, c)
    trace = [req(0.0, 4000, 40, (1,), 1), req(0.01, 2000, 40, (2,), 2)]
    sim.run(trace)
    assert [kind for kind, _ in pol.events] == ["leg", "leg", "observation", "observation"]
    by_id = {o.request_id: o for o in pol.observed}
    for leg, told_at, arrival in zip(pol.legs, pol.told_at, (0.0, 0.01), strict=True):
        obs = by_id[leg.request_id]
        assert (leg.prefill, obs.decode, leg.prompt_tokens, leg.cached_tokens) == ("mixed-0", None, obs.prompt_tokens, None)
        assert obs.queue_and_prefill_s is None
        assert leg.queue_and_prefill_s == obs.ttft_s
        assert told_at == pytest.approx(arrival + leg.queue_and_prefill_s)  # at the first token
    assert pol.legs[0].queue_and_prefill_s > c.truth.prefill_s(4000, 0)  # the prefill and the step sampling it
    quiet = LegScripted(route)  # with observations off, no leg either
    simulate(quiet, trace, replace(c, observe=False))
    assert quiet.events == []
