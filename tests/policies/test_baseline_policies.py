"""Each baseline's distinctive behaviour, as its peer's source defines it."""

from __future__ import annotations

from collections import Counter

import pytest

from conductor.core.types import CachedPrefix, InstanceView, Role, Tier
from policies.dynamo_kv import DynamoKvPolicy
from policies.llmd import LlmdPolicy
from policies.sglang_cache_aware import SglangCacheAwarePolicy
from policies.simple import LeastLoadedPolicy, RandomPolicy
from tests.policies.cluster_builders import decode, prefill, request, routed, snapshot


def test_random_is_seeded_and_uniform() -> None:
    cluster = snapshot(prefill("p0"), prefill("p1"), prefill("p2"), decode("d0"), decode("d1"))
    picks = [RandomPolicy(seed=5).decide(request(rid="same"), cluster) for _ in range(3)]
    assert len({(d.prefill, d.decode) for d in picks}) == 1  # same seed and request, same choice
    pol = RandomPolicy(seed=1)
    counts = Counter(pol.decide(request(rid=str(i)), cluster).prefill for i in range(3000))
    assert set(counts) == {"p0", "p1", "p2"} and all(900 < c < 1100 for c in counts.values())


def test_least_loaded_prefers_fewest_queued_tokens_and_streams() -> None:
    cluster = snapshot(
        prefill("p0", queued=1, tokens=9000),
        prefill("p1", queued=3, tokens=1000),  # more requests but fewer tokens
        decode("d0", streams=5),
        decode("d1", streams=2),
    )
    d = LeastLoadedPolicy().decide(request(cached={"p0": 8000}), cluster)
    assert (d.prefill, d.decode) == ("p1", "d1")  # the cache does not matter to it


def test_sglang_imbalanced_goes_to_shortest_queue() -> None:
    # loads 70 vs 2: diff 68 > 64 and 70 > 1.5 * 2, so load balancing wins over a full cache hit
    cluster = snapshot(prefill("p0", queued=70, tokens=10), prefill("p1", queued=2, tokens=10), decode("d0"))
    d = SglangCacheAwarePolicy().decide(request(cached={"p0": 8192}), cluster)
    assert d.prefill == "p1"
    # 60 vs 2 is within balance_abs_threshold: cache affinity wins
    cluster = snapshot(prefill("p0", queued=60, tokens=10), prefill("p1", queued=2, tokens=10), decode("d0"))
    assert SglangCacheAwarePolicy().decide(request(cached={"p0": 8192}), cluster).prefill == "p0"


def test_sglang_match_threshold_then_smallest_tree() -> None:
    pol = SglangCacheAwarePolicy()
    cluster = snapshot(prefill("p0"), prefill("p1"), prefill("p2"), decode("d0", streams=3), decode("d1"))
    d = routed(pol, request(prompt=1000, cached={"p2": 320}), cluster)  # ratio 0.32 > 0.3
    assert (d.prefill, d.decode) == ("p2", "d1")  # decode: least load
    # below the threshold: the worker with the smallest tree, and trees grow with what was routed
    seen = [routed(pol, request(prompt=1000, cached={"p2": 290}, rid=f"x{i}"), cluster).prefill for i in range(3)]
    assert seen == ["p0", "p1", "p2"]  # trees: p2 680 (its hit was inserted minus the match), then 1000 each


def test_sglang_tree_capped_like_its_eviction() -> None:
    pol = SglangCacheAwarePolicy(max_tree_size=1500)
    cluster = snapshot(prefill("p0"), prefill("p1"), decode("d0"))
    for i in range(6):
        routed(pol, request(prompt=1000, rid=str(i)), cluster)
    assert all(c.detail["tree_tokens"] <= 1500 for c in pol.decide(request(prompt=10), cluster).candidates)


def test_dynamo_cost_formula() -> None:
    pol = DynamoKvPolicy()
    req = request(prompt=1600, cached={"p0": CachedPrefix(800, Tier.DEVICE)}, store=1600)  # 100 blocks
    busy = prefill("p0", queued=2, tokens=480)  # 60 active prefill blocks
    # device 50 blocks credit 1.0, store beyond device 50 blocks credit 0.25; new blocks 100 - 50
    assert pol.prefill_cost(req, busy) == pytest.approx(max(60 + 100 - (50 + 0.25 * 50), 0) + 50)
    host = request(prompt=1600, cached={"p0": CachedPrefix(800, Tier.HOST)})
    assert pol.prefill_cost(host, busy) == pytest.approx(60 + 100 - 0.75 * 50 + 100)
    scaled = DynamoKvPolicy(prefill_load_scale=2.0)
    assert scaled.prefill_cost(host, busy) == pytest.approx(2 * (60 + 100 - 0.75 * 50) + 100)


def test_dynamo_trades_overlap_against_load_and_picks_decode_by_kv_blocks() -> None:
    cluster = snapshot(
        prefill("p0", queued=1, tokens=4000),  # 250 blocks queued, holds 500 blocks of the prompt
        prefill("p1"),
        decode("d0", streams=4, context=1600),
        decode("d1", streams=6, context=320),  # more streams, fewer blocks
    )
    d = DynamoKvPolicy().decide(request(prompt=8000, cached={"p0": 8000}), cluster)
    assert (d.prefill, d.decode) == ("p0", "d1")
    d = DynamoKvPolicy().decide(request(prompt=8000, cached={"p0": 2000}), cluster)
    assert d.prefill == "p1"  # 125 cached blocks no longer pay for 250 queued ones


def test_dynamo_temperature_spreads_choices() -> None:
    cluster = snapshot(prefill("p0"), prefill("p1", queued=1, tokens=800), decode("d0"))
    greedy = Counter(DynamoKvPolicy().decide(request(rid=str(i)), cluster).prefill for i in range(200))
    assert greedy == Counter({"p0": 200})
    warm = DynamoKvPolicy(temperature=1.0, seed=3)
    soft = Counter(warm.decide(request(rid=str(i)), cluster).prefill for i in range(2000))
    # softmax over min-max normalised costs at T=1: p(p1) = e^-1 / (1 + e^-1) ~ 0.27
    assert soft["p1"] / 2000 == pytest.approx(0.269, abs=0.04)


def test_llmd_weighted_normalised_scorers() -> None:
    a = InstanceView("p0", Role.PREFILL, waiting_requests=4, kv_usage=0.5)
    b = InstanceView("p1", Role.PREFILL, waiting_requests=0, kv_usage=0.9)
    c = InstanceView("p2", Role.PREFILL, waiting_requests=2, kv_usage=0.1)
    req = request(prompt=6400, cached={"p0": 6400})
    pol = LlmdPolicy()
    assert pol.scores(req, (a, b, c)) == [
        pytest.approx((0.0, 0.5, 1.0)),
        pytest.approx((1.0, 0.1, 0.0)),
        pytest.approx((0.5, 0.9, 0.0)),
    ]
    # totals: p0 = 2*0 + 2*0.5 + 3*1 = 4.0; p1 = 2.2; p2 = 2.8 -> the prefix hit wins
    d = pol.decide(req, snapshot(a, b, c, decode("d0")))
    assert d.prefill == "p0" and d.candidates[0].score == pytest.approx(-4.0)
    # half the prefix (score 0.5 -> 1.5) no longer beats the emptiest queue and cache
    half = request(prompt=6400, cached={"p0": 3200})
    assert pol.decide(half, snapshot(a, b, c, decode("d0"))).prefill == "p2"


def test_llmd_falls_back_to_gateway_counts() -> None:
    # nothing scraped: queue depth from the gateway's own queue, KV usage from resident/capacity
    p0 = prefill("p0", queued=3)
    p1 = prefill("p1", queued=1)
    d0 = InstanceView("d0", Role.DECODE, kv_capacity_tokens=10_000, decodes=decode("x", 4, 2000).decodes)
    d1 = InstanceView("d1", Role.DECODE, kv_capacity_tokens=10_000)
    d = LlmdPolicy().decide(request(), snapshot(p0, p1, d0, d1))
    assert (d.prefill, d.decode) == ("p1", "d1")


@pytest.mark.parametrize("cls", [RandomPolicy, LeastLoadedPolicy, SglangCacheAwarePolicy, DynamoKvPolicy, LlmdPolicy])
def test_baselines_serve_mixed_workers_and_report_missing_pools(cls: type) -> None:
    pol = cls()
    mixed = snapshot(InstanceView("m0", Role.MIXED), InstanceView("m1", Role.MIXED))
    d = pol.decide(request(), mixed)
    assert d.prefill in {"m0", "m1"} and d.decode is None and not d.rejected
    d = pol.decide(request(), snapshot(prefill("p0")))
    assert d.rejection is not None and d.rejection.reason == "no_instance" and "decode" in d.rejection.message


@pytest.mark.parametrize("factory", [DynamoKvPolicy, LlmdPolicy, LeastLoadedPolicy, SglangCacheAwarePolicy])
def test_listed_candidates_lists_the_best_and_the_chosen_and_decides_the_same(factory: type) -> None:
    """`listed_candidates` changes only which scores a decision carries (the decision log's part):
    the same placement, each listed score as the full list has it, the rest counted as unlisted."""
    cluster = snapshot(
        prefill("p0", queued=3),
        prefill("p1", queued=1, tokens=500),
        prefill("p2"),
        prefill("p3", queued=2),
        decode("d0", streams=4),
        decode("d1", streams=1),
        decode("d2", streams=6),
    )
    for rid in ("a", "b", "c"):
        req = request(cached={"p3": 4096, "p0": 1024}, rid=rid)
        full = factory().decide(req, cluster)
        short = factory(listed_candidates=1).decide(req, cluster)
        assert (short.prefill, short.decode, short.rejection) == (full.prefill, full.decode, full.rejection)
        assert full.unlisted_candidates == 0
        assert all(c in full.candidates for c in short.candidates)
        assert short.unlisted_candidates == len(full.candidates) - len(short.candidates) > 0
        assert full.prefill in {c.instance_id for c in short.candidates}
    with pytest.raises(ValueError, match="listed_candidates"):
        factory(listed_candidates=0)
