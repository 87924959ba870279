"""Prefixes in flight: the table's bounds and bisection, and kvcache_aware placing a request that
shares a prefix just dispatched (the index cannot show it yet) behind it, where it will be cached."""

from __future__ import annotations

import random

import pytest

from conductor.core.errors import ConfigError
from conductor.core.types import ClusterSnapshot, InstanceView, Observation, QueuedPrefill, RequestView, Role, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.kvcache_aware.inflight import InflightPrefixes


def chain(*keys: int) -> tuple[int, ...]:
    return tuple(keys)


ONE = 256  # a block size at which every key is filed (stride 256 tokens = one block)


def test_longest_is_the_deepest_key_of_the_chain_present_and_names_its_instance() -> None:
    t = InflightPrefixes()
    t.add("a", chain(1, 2, 3, 4), "p0", ONE)
    t.add("b", chain(1, 2, 9), "p1", ONE)  # shares two blocks, newer: those now point to p1
    assert t.longest(chain(1, 2, 3, 4, 5), ONE) == ("p0", 4)
    assert t.longest(chain(1, 2, 9, 7), ONE) == ("p1", 3)
    assert t.longest(chain(1, 2), ONE) == ("p1", 2)
    assert t.longest(chain(8, 12, 13), ONE) is None
    assert t.longest((), ONE) is None


def test_forgetting_keeps_what_a_newer_dispatch_shares() -> None:
    t = InflightPrefixes()
    t.add("a", chain(1, 2, 3), "p0", ONE)
    t.add("b", chain(1, 2), "p1", ONE)
    t.forget("a")
    assert t.longest(chain(1, 2, 3), ONE) == ("p1", 2)
    t.forget("b")
    assert t.longest(chain(1, 2, 3), ONE) is None and len(t) == 0
    t.forget("never-added")  # harmless


def test_the_bound_forgets_oldest_first_and_a_chain_past_it_is_not_filed() -> None:
    t = InflightPrefixes(max_keys=6)
    t.add("a", chain(1, 2, 3), "p0", ONE)
    t.add("b", chain(10, 11, 12), "p1", ONE)
    t.add("c", chain(20, 21), "p2", ONE)  # 8 keys: "a" goes
    assert t.longest(chain(1, 2, 3), ONE) is None
    assert t.longest(chain(10, 11, 12), ONE) == ("p1", 3) and t.longest(chain(20, 21), ONE) == ("p2", 2)
    t.add("d", tuple(range(100, 107)), "p3", ONE)  # 7 keys: more than the bound, not filed at all
    assert t.longest(tuple(range(100, 107)), ONE) is None
    with pytest.raises(ValueError):
        InflightPrefixes(max_keys=0)


@pytest.mark.parametrize("block_size", [ONE, 64, 16])  # every key filed, every 4th, every 16th
def test_bisection_credits_the_prefix_a_linear_scan_finds_less_at_most_a_stride(block_size: int) -> None:
    rng = random.Random(7)
    t = InflightPrefixes(max_keys=200)
    stride = max(1, 256 // block_size)
    live: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # request -> (chain, keys filed)
    order: list[str] = []
    for step in range(3000):
        # chains of a small tree: prompts share prefixes as real ones do
        depth = rng.randint(1, 40)
        raw = tuple(rng.randint(0, 2) * 100 + i for i in range(depth))
        keys = tuple(hash(raw[: i + 1]) for i in range(depth))
        if rng.random() < 0.3 and order:
            rid = order.pop(rng.randrange(len(order)))
            t.forget(rid)
            live.pop(rid, None)
        rid = f"r{step}"
        t.add(rid, keys, f"p{step % 4}", block_size)
        filed = keys[stride - 1 :: stride] + ((keys[-1],) if depth % stride else ())
        live[rid] = (keys, filed)
        order.append(rid)
        while sum(len(f) for _, f in live.values()) > 200:  # the table's own eviction, mirrored
            oldest = next(iter(live))
            live.pop(oldest)
            order.remove(oldest)
        probe = (*keys[: rng.randint(1, depth)], 123456789)
        present = {k for ks, _ in live.values() for k in ks}
        shared = 0  # the longest prefix of the probe some remembered dispatch is computing
        while shared < len(probe) and probe[shared] in present:
            shared += 1
        found = t.longest(probe, block_size)
        blocks = found[1] if found else 0
        assert shared - stride < blocks <= shared, (step, shared, blocks)
        if found:  # and the instance named is one computing that much of it
            owners = {f"p{int(r[1:]) % 4}" for r, (ks, _) in live.items() if ks[:blocks] == probe[:blocks]}
            assert found[0] in owners


def test_a_long_prompt_files_a_key_every_stride_and_its_last() -> None:
    t = InflightPrefixes()
    keys = tuple(range(1000, 1000 + 2050))  # 32,800 tokens at 16 per block
    t.add("long", keys, "p0", 16)
    assert t._keys == 2050 // 16 + 1  # 128 stride points and the last key
    assert t.longest(keys, 16) == ("p0", 2050)
    assert t.longest((*keys[:2010], 7), 16) == ("p0", 2000)  # the stride point below 2,010 blocks
    assert t.longest(keys[:15], 16) is None  # shorter than one stride and not a filed last key


BS = 16


def pool(queued: dict[str, int]) -> ClusterSnapshot:
    """Two prefills and a decode; `queued`: prefill id -> new tokens already waiting there."""
    prefills = tuple(
        InstanceView(
            id=name,
            role=Role.PREFILL,
            prefill_queue=(QueuedPrefill(new_tokens=queued[name], cached_tokens=0, elapsed_s=0.0),) if queued[name] else (),
        )
        for name in ("p0", "p1")
    )
    return ClusterSnapshot(now=0.0, instances=(*prefills, InstanceView(id="d0", role=Role.DECODE)))


def request(rid: str, seq: int, blocks: int, **kw: object) -> RequestView:
    return RequestView(
        request_id=rid,
        seq=seq,
        model="m",
        prompt_tokens=blocks * BS + 8,
        max_tokens=16,
        block_size=BS,
        block_keys=tuple(range(1, blocks + 1)),
        slo=Slo(ttft_s=30.0, tbt_s=1.0),
        **kw,
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("inflight", [True, False])
def test_a_request_sharing_a_dispatched_prefix_follows_it_when_its_slack_allows(inflight: bool) -> None:
    policy = KvCacheAwarePolicy(admission="none", allow_pull=False, online=False, ttft_slack=0.5, inflight_prefixes=inflight)
    first = request("a", 1, 400)  # 6,408 tokens, nothing cached anywhere
    cluster = pool({"p0": 0, "p1": 0})
    d1 = policy.decide(first, cluster)
    policy.on_decided(first, cluster, d1)
    holder = d1.prefill
    assert holder is not None
    other = "p1" if holder == "p0" else "p0"
    # the first is now queued on its instance; the index shows nothing cached yet
    busy = pool({holder: first.prompt_tokens, other: 0})
    second = request("b", 2, 420)  # the same 400 blocks and 20 more
    d2 = policy.decide(second, busy)
    chosen = next(c for c in d2.candidates if c.instance_id == d2.prefill)
    if inflight:
        assert d2.prefill == holder and chosen.detail["cached_tokens"] == 400 * BS
    else:  # blind: the idle instance looks faster and recomputes the whole prefix
        assert d2.prefill == other and chosen.detail["cached_tokens"] == 0
    policy.on_decided(second, busy, d2)
    if inflight:
        for rid, req in (("a", first), ("b", second)):
            policy.observe(
                Observation(
                    request_id=rid,
                    prefill=holder,
                    decode="d0",
                    prompt_tokens=req.prompt_tokens,
                    cached_tokens=None,
                    predicted_cached_tokens=0,
                    queue_and_prefill_s=None,
                    ttft_s=None,
                )
            )
        assert policy.inflight is not None and len(policy.inflight) == 0  # observed: the index knows now


def test_ttft_slack_takes_the_least_compute_within_the_slack_and_the_fastest_past_it() -> None:
    from conductor.core.types import CachedPrefix

    cluster = ClusterSnapshot(
        now=0.0,
        instances=(
            InstanceView(
                id="p0", role=Role.PREFILL, prefill_queue=(QueuedPrefill(new_tokens=12000, cached_tokens=0, elapsed_s=0.0),)
            ),
            InstanceView(id="p1", role=Role.PREFILL),
            InstanceView(id="d0", role=Role.DECODE),
        ),
    )

    def decide(slack: float | None, slo: float | None) -> tuple[str | None, dict[str, float]]:
        """The chosen prefill and each candidate's bounded client TTFT, as the slack judges it."""
        policy = KvCacheAwarePolicy(admission="none", allow_pull=False, online=False, ttft_slack=slack)
        req = RequestView(
            request_id="r",
            seq=1,
            model="m",
            prompt_tokens=6000,
            max_tokens=16,
            block_size=BS,
            cached={"p0": CachedPrefix(5600)},
            slo=Slo(ttft_s=slo, tbt_s=1.0),
        )
        d = policy.decide(req, cluster)
        pred = policy.predictors
        tbt = next(c.predicted_tbt_s for c in d.candidates if c.instance_id == "d0")
        assert tbt is not None
        bounds = {}
        for c in d.candidates:
            if c.predicted_ttft_s is not None:
                x = c.detail
                client = x["transfer_s"] + x["queue_s"] + x["prefill_s"] + pred.first_token_s(x["handoff_s"], tbt)
                bounds[c.instance_id] = pred.bound("ttft", client, 0.95)
        return d.prefill, bounds

    fastest, bounds = decide(None, 30.0)
    # the holder of the prefix is behind a long queue: the idle instance is faster
    assert fastest == "p1" and bounds["p0"] > bounds["p1"]
    # both bounds within half the SLO: the holder, which computes 400 tokens instead of 6,000
    assert decide(0.5, 2.01 * bounds["p0"])[0] == "p0"
    # the holder's bound past the slack, the idle one's within it: the idle one
    assert decide(0.5, 2 * (bounds["p0"] + bounds["p1"]) / 2)[0] == "p1"
    # the holder's point prediction of its client TTFT fits the slack, its calibrated bound does
    # not: judged as admission judges it, the idle instance
    point = bounds["p0"] / KvCacheAwarePolicy(online=False).predictors.params.prefill.p90_ratio
    assert point < bounds["p0"] and bounds["p1"] < (point + bounds["p0"]) / 2
    assert decide(0.5, 2 * (point + bounds["p0"]) / 2)[0] == "p1"
    # no TTFT SLO on the request: the slack has nothing to measure against, the fastest wins
    assert decide(0.5, None)[0] == "p1"
    with pytest.raises(ConfigError, match="ttft_slack"):
        KvCacheAwarePolicy(online=False, ttft_slack=1.5)


def test_the_slack_waits_for_a_prefill_model_fitted_to_the_fleet() -> None:
    # a learning policy that has seen no leg yet holds the bundled profile's seconds, perhaps a
    # faster GPU's: the slack (seconds against the SLO) waits for its first refit, the lowest TTFT
    # (an order of the instances, which a wrong scale keeps) places meanwhile
    from conductor.core.types import CachedPrefix

    cluster = ClusterSnapshot(
        now=0.0,
        instances=(
            InstanceView(id="p0", role=Role.PREFILL, prefill_queue=(QueuedPrefill(12000, 0, 0.0),)),
            InstanceView(id="p1", role=Role.PREFILL),
            InstanceView(id="d0", role=Role.DECODE),
        ),
    )
    req = RequestView("r", 1, "m", 6000, 16, block_size=BS, cached={"p0": CachedPrefix(5600)}, slo=Slo(ttft_s=60.0, tbt_s=1.0))
    policy = KvCacheAwarePolicy(admission="none", allow_pull=False, ttft_slack=0.5)
    assert not policy.predictors.prefill_fitted
    assert policy.decide(req, cluster).prefill == "p1"  # the fastest, not the holder
    for n in range(1000, 9000, 1000):  # eight legs of this fleet: the first refit
        policy.predictors.observe_leg((1.0, float(n), float(n * n)), 2 * policy.predictors.prefill_s(n))
    assert policy.predictors.prefill_fitted
    assert policy.decide(req, cluster).prefill == "p0"  # both well within the slack: the least compute
    assert KvCacheAwarePolicy(online=False).predictors.prefill_fitted  # not learned: taken as given
