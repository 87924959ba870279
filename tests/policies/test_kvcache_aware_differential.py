"""The KVCache-aware policy's pool-wide shortcuts decide exactly as estimating every instance in full.

`_decide` weighs instances that hold no prefix of the request (and are no pull source) with one
shared prefix plan plus their own queue, reads each decode instance's load as a count and a sum,
scans mixed workers in TTFT order only until one meets the TBT SLO (under admission's calibrated
bound; the lowest bound among equal TTFTs) or, with `mixed_ttft_slack`, only those whose TTFT fits
in the slack, for the fewest stream-seconds stalled, and lists only the best few
candidates. `ReferencePolicy` below is the algorithm as it was before those shortcuts (a full
PrefillEstimate / DecodeEstimate per instance, min() over all of them, every candidate listed;
with `ttft_slack`, min() by least compute among those whose bounded client TTFT, computed per
candidate, is within the slack):
both run on thousands of seeded random clusters and must agree on everything a decision says.
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import MappingProxyType

import pytest

from conductor.core.errors import ConfigError
from conductor.core.types import (
    ActiveDecode,
    CachedPrefix,
    ClusterSnapshot,
    Decision,
    InstanceView,
    QueuedPrefill,
    RequestView,
    Role,
    Slo,
    Tier,
)
from policies.admission import AdmissionMode, admit, stall_rejection
from policies.base import no_instance
from policies.estimate import (
    DecodeEstimate,
    JoinForecast,
    PrefillEstimate,
    estimate_decode,
    prefill_pool,
    remote_sources,
)
from policies.kvcache_aware import KvCacheAwarePolicy, decode_candidate, prefill_candidate
from policies.kvcache_aware.learning import _chosen_candidates
from predictors import LinearModel, OnlineConfig, Predictors, bundled_profile, fit_profiles
from predictors.overrun import overrun_scale
from predictors.params import INSTANCE_LINK, STORE_LINK


def reference_estimate_prefill(
    pred: Predictors,
    request: RequestView,
    inst: InstanceView,
    sources: list[tuple[int, str, str]],
    allow_pull: bool,
    disaggregated: bool,
) -> PrefillEstimate:
    n = max(1, request.prompt_tokens)
    own = request.cached.get(inst.id)
    local = min(own.tokens, n - 1) if own is not None and own.tier is not Tier.STORE else 0
    best_prefill = pred.prefill_s(n - local, local)
    best_transfer, prefix, pulled, source = 0.0, local, 0, None
    if allow_pull:
        seen_links: set[str] = set()
        for tokens, src, link in sources:
            if src == inst.id or link in seen_links:
                continue
            seen_links.add(link)
            cand = min(tokens, n - 1)
            if cand <= local:
                continue
            t_x = pred.transfer_s(cand - local, link)
            t_p = pred.prefill_s(n - cand, cand)
            if t_x + t_p < best_transfer + best_prefill:
                best_transfer, best_prefill, prefix, pulled, source = t_x, t_p, cand, cand - local, src
    queue = pred.queue_s(inst.prefill_queue)
    handoff = pred.transfer_s(n) if disaggregated else 0.0
    return PrefillEstimate(
        inst, best_transfer + queue + best_prefill + handoff, best_transfer, queue, best_prefill, handoff, prefix, pulled, source
    )


class ReferencePolicy(KvCacheAwarePolicy):
    """Every instance estimated in full and listed: the slow algorithm the shortcuts must equal."""

    def _decide(self, request: RequestView, cluster: ClusterSnapshot, only_p: str | None, only_d: str | None) -> Decision:
        pred, opts = self.predictors, self.options
        prefills, disaggregated = prefill_pool(cluster)
        if only_p is not None:
            prefills = tuple(p for p in prefills if p.id == only_p)
        if not prefills:
            return no_instance(request, self.name, Role.PREFILL if disaggregated else Role.MIXED)
        decodes = cluster.by_role(Role.DECODE) if disaggregated else ()
        if only_d is not None:
            decodes = tuple(d for d in decodes if d.id == only_d)
        if disaggregated and not decodes:
            return no_instance(request, self.name, Role.DECODE)
        scale = overrun_scale(pred, prefills, mixed=not disaggregated)  # predictors/overrun.py, as the policy
        if scale > 1.0:
            pred = pred.prefill_scaled(scale)
        sources = []
        if self.pull_links and only_p is None and (request.cached or request.store_cached_tokens or request.pull_sources):
            sources = [s for s in remote_sources(request) if s[2] in self.pull_links]
        ests = [reference_estimate_prefill(pred, request, p, sources, bool(sources), disaggregated) for p in prefills]
        predicted = self.admission is AdmissionMode.PREDICTED
        slack_s = (
            None
            if opts.placement.ttft_slack is None or request.slo.ttft_s is None or not disaggregated or not pred.prefill_fitted
            else opts.placement.ttft_slack * request.slo.ttft_s
        )  # mixed workers: the lowest TTFT always
        chosen_decode: DecodeEstimate | None = None
        stalled: PrefillEstimate | None = None  # mixed: the chosen worker's streams cannot absorb it
        if disaggregated:
            d_ests = [estimate_decode(pred, request, d, 0.0) for d in decodes]
            chosen_decode = min(d_ests, key=lambda e: (e.tbt_s, e.batch))

        def fits(e: PrefillEstimate) -> bool:
            # the client TTFT with the chosen decode's TBT now, bounded as admission bounds it
            assert slack_s is not None and chosen_decode is not None
            client = e.transfer_s + e.queue_s + e.prefill_s + pred.first_token_s(e.handoff_s, chosen_decode.tbt_s)
            bound = client if opts.admission.ttft_quantile is None else pred.bound("ttft", client, opts.admission.ttft_quantile)
            return bound <= slack_s

        def rank(e: PrefillEstimate) -> tuple[int, float, float]:
            # within the slack the least compute first (lowest TTFT among equals), then the rest by TTFT
            if slack_s is None:
                return (0, 0.0, e.ttft_s)
            return (0, e.prefill_s, e.ttft_s) if fits(e) else (1, 0.0, e.ttft_s)

        if disaggregated:
            best = min(ests, key=rank)
        else:
            d_ests = [estimate_decode(pred, request, e.instance, e.ttft_s if predicted else 0.0, None) for e in ests]
            slo = request.slo.tbt_s
            pairs = list(zip(ests, d_ests, strict=True))
            # the TBT judged under admission's calibrated bound; among equal TTFTs the lowest such TBT
            mixed_q = opts.mixed.tbt_quantile
            ratio = (
                1.0
                if mixed_q is None
                else pred.ratios.quantile("tbt_judged", mixed_q, pred.params.tbt.p90_ratio if mixed_q > 0.5 else 1.0)
            )

            def bound(pair: tuple[PrefillEstimate, DecodeEstimate]) -> float:  # an idle worker is not judged
                idle = not pair[0].instance.decodes and not pair[0].instance.prefill_queue
                return 0.0 if idle else pair[1].tbt_s * ratio

            def absorbs(pair: tuple[PrefillEstimate, DecodeEstimate]) -> bool:
                # with admission, only a worker whose streams keep their TBT SLO through this prefill:
                # at most a tenth of them lack the spare TBT per remaining token to absorb it
                if not opts.mixed.protect_streams or slo is None or self.admission is AdmissionMode.NONE:
                    return True
                e, spare = pair[0], slo - bound(pair)
                short = [a for a in e.instance.decodes if a.remaining_tokens > 0 and e.prefill_s > spare * a.remaining_tokens]
                return len(short) <= len(e.instance.decodes) // 10

            def placed_bound(pair: tuple[PrefillEstimate, DecodeEstimate]) -> float:
                return bound(pair) if absorbs(pair) else float("inf")  # streams that cannot absorb it: fits nowhere

            fitting = [pair for pair in pairs if slo is None or placed_bound(pair) <= slo] or pairs
            best, chosen_decode = min(fitting, key=lambda pair: (rank(pair[0]), placed_bound(pair)))
            ttft_slo, mixed_slack = request.slo.ttft_s, opts.mixed.ttft_slack
            if mixed_slack is not None and ttft_slo is not None:
                # the fewest stream-seconds stalled, (prefill compute) x (streams there + 1), among the
                # workers whose bounded TTFT fits in the slack and whose TBT bound meets the SLO
                def ttft_fits(e: PrefillEstimate) -> bool:
                    b = (
                        e.ttft_s
                        if opts.admission.ttft_quantile is None
                        else pred.bound("ttft", e.ttft_s, opts.admission.ttft_quantile)
                    )
                    return b <= mixed_slack * ttft_slo

                calm = [pair for pair in pairs if ttft_fits(pair[0]) and (slo is None or bound(pair) <= slo) and absorbs(pair)]
                if calm:
                    best, chosen_decode = min(
                        calm, key=lambda pair: (pair[0].prefill_s * (len(pair[0].instance.decodes) + 1), pair[0].ttft_s)
                    )
            if not absorbs((best, chosen_decode)):
                stalled = best
        judged = chosen_decode
        if disaggregated and predicted and chosen_decode is not None:
            pool = prefill_pool(cluster)[0] if only_p is not None else prefills
            joins = JoinForecast(pred, pool, len(cluster.by_role(Role.DECODE))) if opts.admission.forecast_joins else None
            judged = estimate_decode(pred, request, chosen_decode.instance, best.ttft_s, joins)
        elif self.admission is AdmissionMode.EARLY and chosen_decode is not None:
            judged = estimate_decode(pred, request, chosen_decode.instance, 0.0, None, include_pending=False)
        tbt = None
        first_tbt = 0.0
        if chosen_decode is not None:
            tbt = first_tbt = judged.tbt_s if predicted and judged is not None else chosen_decode.tbt_s
        leg = best.transfer_s + best.queue_s + best.prefill_s
        ttft = leg + pred.first_token_s(best.handoff_s, first_tbt) if disaggregated else best.ttft_s
        ttft_bound = ttft if opts.admission.ttft_quantile is None else pred.bound("ttft", ttft, opts.admission.ttft_quantile)
        tbt_bound = None
        tbt_q = opts.admission.tbt_quantile if disaggregated else opts.mixed.tbt_quantile
        if judged is not None and tbt_q is not None:
            tbt_bound = judged.tbt_s * pred.ratios.quantile(
                "tbt_judged", tbt_q, pred.params.tbt.p90_ratio if tbt_q > 0.5 else 1.0
            )
        if not disaggregated and not best.instance.decodes and not best.instance.prefill_queue:
            judged = None  # an idle mixed worker's TBT is not judged
        rejection = admit(
            pred, request, self.admission, best, judged, ttft_s=ttft, ttft_bound_s=ttft_bound, tbt_bound_s=tbt_bound
        )
        if rejection is None and stalled is not None and chosen_decode is not None:
            rejection = stall_rejection(request, stalled.instance, stalled.prefill_s, chosen_decode.tbt_s)
        candidates = tuple(
            prefill_candidate(e, None if disaggregated else e.prefill_s * (len(e.instance.decodes) + 1)) for e in ests
        ) + tuple(decode_candidate(e, judged if e is chosen_decode else None) for e in d_ests)
        if (
            rejection is not None
            and opts.admission.probe_after is not None
            and self._rejected_in_a_row >= opts.admission.probe_after
        ):
            rejection = None
        if rejection is not None:
            return Decision(
                request.request_id,
                self.name,
                rejection=rejection,
                predicted_ttft_s=ttft,
                predicted_tbt_s=tbt,
                candidates=candidates,
            )
        decode_id = chosen_decode.instance.id if disaggregated and chosen_decode is not None else None
        return Decision(
            request.request_id,
            self.name,
            prefill=best.instance.id,
            decode=decode_id,
            predicted_ttft_s=ttft,
            predicted_tbt_s=tbt,
            pull_from=best.pull_from,
            pull_tokens=best.pulled_tokens,
            candidates=candidates,
        )


# ---- random clusters ------------------------------------------------------------------------


def random_queue(rng: random.Random, shared: tuple[QueuedPrefill, ...]) -> tuple[QueuedPrefill, ...]:
    roll = rng.random()
    if roll < 0.3:
        return ()  # idle: many instances predict exactly the same TTFT, so ties and their order matter
    if roll < 0.5:
        return shared  # the same queue as others: equal TTFTs again
    return tuple(random_prefill(rng) for _ in range(rng.randint(1, 6)))


def random_prefill(rng: random.Random) -> QueuedPrefill:
    """A queued prefill; run for up to about its predicted time, or now and then (1 in 30) for up
    to 2 s, far past it on a small prompt: prefills overrunning (predictors/overrun.py), rare live."""
    new_tokens, cached_tokens = rng.choice((16, rng.randint(1, 16384))), rng.choice((0, rng.randint(0, 8192)))
    roll = rng.random()
    elapsed = 0.0 if roll < 0.5 else rng.uniform(0, 2.0) if roll < 0.5 + 1 / 30 else rng.uniform(0, 0.03 + 3e-5 * new_tokens)
    return QueuedPrefill(new_tokens, cached_tokens, elapsed)


def random_decodes(rng: random.Random, shared: tuple[ActiveDecode, ...]) -> tuple[ActiveDecode, ...]:
    roll = rng.random()
    if roll < 0.15:
        return ()
    if roll < 0.35:
        return shared
    return tuple(
        ActiveDecode(rng.randint(1, 40000), rng.randint(0, 2000), decoding=rng.random() < 0.8) for _ in range(rng.randint(1, 60))
    )


def random_case(rng: random.Random, i: int) -> tuple[RequestView, ClusterSnapshot]:
    mixed = rng.random() < 0.25
    big = rng.random() < 0.1
    n_p = rng.randint(1, 120 if big else 24)
    n_d = 0 if mixed else rng.randint(1, 120 if big else 24)
    shared_q = random_queue(rng, ())
    shared_d = random_decodes(rng, ())
    p_role = Role.MIXED if mixed else Role.PREFILL
    names = [f"p{k}" for k in range(n_p)]
    if rng.random() < 0.1:
        names[rng.randrange(n_p)] = "store"  # named like the store source: must not pull from "itself"
    views = [
        InstanceView(
            name,
            p_role,
            healthy=rng.random() > 0.1,
            prefill_queue=random_queue(rng, shared_q),
            decodes=random_decodes(rng, shared_d) if mixed else (),
        )
        for name in names
    ]
    views += [
        InstanceView(f"d{k}", Role.DECODE, healthy=rng.random() > 0.1, decodes=random_decodes(rng, shared_d)) for k in range(n_d)
    ]
    rng.shuffle(views)
    prompt = rng.choice((1, 2, 16, rng.randint(1, 20000), rng.randint(1, 20000)))
    holders = rng.sample(names + [f"d{k}" for k in range(n_d)] + ["gone"], rng.randint(0, min(8, n_p)))
    cached = {
        h: CachedPrefix(
            rng.choice((0, 16 * rng.randint(1, 1300), prompt, prompt + 64)), rng.choice((Tier.DEVICE, Tier.HOST, Tier.STORE))
        )
        for h in holders
    }
    pull_sources = None
    if rng.random() < 0.5:
        offered = rng.sample(names + [f"d{k}" for k in range(n_d)], rng.randint(0, min(4, n_p)))
        pull_sources = {s: rng.choice((0, 16 * rng.randint(1, 1300))) for s in offered}
    slo = Slo(
        ttft_s=rng.choice((None, rng.uniform(0.01, 0.5), rng.uniform(0.5, 4.0))),
        tbt_s=rng.choice((None, rng.uniform(0.005, 0.03), rng.uniform(0.03, 0.08))),
    )
    request = RequestView(
        f"r{i}",
        i,
        "m",
        prompt,
        rng.randint(1, 512),
        cached=cached,
        slo=slo,
        pull_sources=pull_sources,
        store_cached_tokens=rng.choice((0, 0, 16 * rng.randint(1, 1300))),
    )
    return request, ClusterSnapshot(now=100.0, instances=tuple(views))


def predictor_sets() -> list[Predictors]:
    params = fit_profiles([bundled_profile()])
    fast = LinearModel((0.002, 1.0 / 50e9))  # pulls win often
    slow = LinearModel((0.004, 1.0 / 2e9))  # pulls rarely win
    out = []
    links: list[dict[str, LinearModel]] = [
        {},
        {INSTANCE_LINK: fast, STORE_LINK: slow},
        {INSTANCE_LINK: slow, STORE_LINK: fast},
        {INSTANCE_LINK: fast, STORE_LINK: fast},
    ]
    for link in links:
        p = replace(params, transfer=MappingProxyType({**params.transfer, **link}))
        pred = Predictors(p, OnlineConfig(enabled=False))
        for k in range(40):  # calibrated bounds away from their defaults
            pred.ratios.add("ttft", 1.0, 0.8 + 0.02 * k)
            pred.ratios.add("tbt_judged", 1.0, 0.9 + 0.01 * k)
        out.append(pred)
    return out


OPTIONS: list[dict[str, object]] = [
    {"admission": "predicted"},
    {"admission": "early"},
    {"admission": "none"},
    {"admission": "predicted", "forecast_joins": True, "ttft_quantile": None, "tbt_quantile": None, "mixed_tbt_quantile": None},
    {"admission": "predicted", "mixed_tbt_quantile": 0.9},
    {"admission": "predicted", "mixed_ttft_slack": None},  # mixed workers: the lowest TTFT that meets the TBT SLO
    {"admission": "none", "mixed_ttft_slack": 0.3, "ttft_quantile": None},
    {"admission": "predicted", "allow_pull": "peer"},
    {"admission": "early", "allow_pull": "store"},
    {"admission": "predicted", "allow_pull": False},
    {"admission": "predicted", "ttft_slack": None},  # the paper's Algorithm 1: the lowest TTFT
    {"admission": "none", "ttft_slack": 1.0, "allow_pull": "peer"},
    {"admission": "early", "ttft_slack": 0.1},
]


def same_but_listing(fast: Decision, full: Decision, limit: int) -> None:
    """`fast` lists a subset of `full`'s candidates (in order) and counts the rest; all else equal."""
    assert replace(fast, candidates=(), unlisted_candidates=0) == replace(full, candidates=())
    listed = iter(full.candidates)
    assert all(any(c == f for f in listed) for c in fast.candidates), "not an ordered subset of the full listing"
    assert len(fast.candidates) + fast.unlisted_candidates == len(full.candidates)
    for role in (Role.PREFILL, Role.DECODE, Role.MIXED):
        mine = [c for c in fast.candidates if c.role is role]
        every = [c for c in full.candidates if c.role is role]
        if not every:
            continue
        if role is Role.MIXED:  # a mixed worker is listed twice: as prefill (TTFT) and decode (TBT)
            mine = [c for c in mine if c.predicted_ttft_s is not None]
            every = [c for c in every if c.predicted_ttft_s is not None]
        cut = sorted(c.score for c in every)[min(limit, len(every)) - 1]
        # the best `limit` by score, and the chosen one (a mixed worker chosen for its TBT may score worse)
        assert len(mine) <= limit + 1 and sum(c.score > cut for c in mine) <= 1
    if fast.rejection is None:
        assert _chosen_candidates(fast) is not None  # what on_decided learns from is listed


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_decisions_equal_the_full_estimate_on_random_clusters(seed: int) -> None:
    rng = random.Random(seed)
    preds = predictor_sets()
    stats = {
        "rejected": 0,
        "pulled": 0,
        "unlisted": 0,
        "mixed": 0,
        "judged": 0,
        "tied": 0,
        "mixed_tbt_moved": 0,
        "slack_moved": 0,
        "stall_moved": 0,
        "overrun": 0,  # a decision behind prefills past their prediction (predictors/overrun.py)
    }
    for i in range(800):
        request, cluster = random_case(rng, i)
        pred = preds[i % len(preds)]
        options = {**OPTIONS[i % len(OPTIONS)], "probe_after": rng.choice((None, 0, 2))}
        reference = ReferencePolicy(predictors=pred, **options)  # type: ignore[arg-type]
        every = KvCacheAwarePolicy(predictors=pred, listed_candidates=None, **options)  # type: ignore[arg-type]
        limit = rng.choice((1, 3, 8))
        few = KvCacheAwarePolicy(predictors=pred, listed_candidates=limit, **options)  # type: ignore[arg-type]
        for policy in (reference, every, few):
            policy._rejected_in_a_row = 1  # probes (probe_after 0) and their absence (2) both taken
        full = reference.decide(request, cluster)
        assert every.decide(request, cluster) == full, (seed, i)
        listed = few.decide(request, cluster)
        same_but_listing(listed, full, limit)
        stats["rejected"] += full.rejection is not None
        stats["pulled"] += full.pull_tokens > 0
        stats["unlisted"] += listed.unlisted_candidates > 0
        stats["mixed"] += any(v.role is Role.MIXED for v in cluster.instances)
        stats["overrun"] += overrun_scale(pred, prefill_pool(cluster)[0], mixed=full.decode is None) > 1.0
        ttfts = [c.score for c in full.candidates if c.predicted_ttft_s is not None]
        stats["tied"] += ttfts.count(min(ttfts, default=0.0)) > 1  # equal best TTFTs: the pool order decides
        fastest = next((c.instance_id for c in full.candidates if c.score == min(ttfts, default=0.0)), None)
        stats["mixed_tbt_moved"] += full.decode is None and full.prefill not in (None, fastest)
        stats["slack_moved"] += full.decode is not None and full.prefill not in (None, fastest)  # less compute won
        if full.decode is None and full.prefill is not None and options.get("mixed_ttft_slack", 0.8) is not None:
            by_ttft = ReferencePolicy(predictors=pred, **{**options, "mixed_ttft_slack": None})  # type: ignore[arg-type]
            by_ttft._rejected_in_a_row = 1
            stats["stall_moved"] += by_ttft.decide(request, cluster).prefill != full.prefill  # fewer streams stalled won
        tbts = [c.predicted_tbt_s for c in full.candidates if c.role is Role.MIXED and c.predicted_tbt_s is not None]
        if tbts:  # a TBT SLO a worker meets exactly: `<=` fits, so the boundary must be the reference's
            at_bound = replace(request, slo=replace(request.slo, tbt_s=rng.choice(tbts)))
            assert every.decide(at_bound, cluster) == reference.decide(at_bound, cluster), (seed, i)
        # a placement chosen by someone else, judged by this policy (the simulator's baselines)
        up = [v for v in cluster.instances if v.healthy]
        if up and rng.random() < 0.3:
            p, d = rng.choice(up).id, rng.choice(up).id if rng.random() < 0.8 else None
            assert every.judge(request, cluster, p, d) == reference.judge(request, cluster, p, d)
            stats["judged"] += 1
    # the random cases reach every branch the shortcuts take
    assert all(v > 10 for v in stats.values()), str(stats)


def test_a_large_pool_lists_the_best_few_and_counts_the_rest() -> None:
    queues = [tuple(QueuedPrefill(4000, 0, 0.0) for _ in range(k % 7)) for k in range(20)]
    views = [InstanceView(f"p{k}", Role.PREFILL, prefill_queue=q) for k, q in enumerate(queues)]
    views += [InstanceView(f"d{k}", Role.DECODE, decodes=tuple(ActiveDecode(3000, 100) for _ in range(k % 9))) for k in range(20)]
    cluster = ClusterSnapshot(now=1.0, instances=tuple(views))
    request = RequestView("r1", 1, "m", 8192, 64, cached={"p14": CachedPrefix(8000)})
    policy = KvCacheAwarePolicy(online=False)
    decision = policy.decide(request, cluster)
    full = ReferencePolicy(online=False).decide(request, cluster)
    assert decision.prefill == full.prefill == "p14" and decision.decode == full.decode
    listed = {role: [c.instance_id for c in decision.candidates if c.role is role] for role in (Role.PREFILL, Role.DECODE)}
    assert len(listed[Role.PREFILL]) == len(listed[Role.DECODE]) == 8 and decision.unlisted_candidates == 24
    best = sorted((c for c in full.candidates if c.role is Role.PREFILL), key=lambda c: c.score)[:8]
    assert set(listed[Role.PREFILL]) == {c.instance_id for c in best}
    # what on_decided learns from is among what is listed
    policy.on_decided(request, cluster, decision)
    assert "r1" in policy.learner.pending
    with pytest.raises(ConfigError, match="listed_candidates"):
        KvCacheAwarePolicy(online=False, listed_candidates=0)
