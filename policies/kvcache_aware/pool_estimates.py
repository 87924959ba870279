"""estimate_prefill for every instance of a pool at once, with no more prefix plans than differ.

The decision's hot path: kvcache_aware weighs every prefill instance for every request, so on a
large pool most of its cost would be walking the prefix sources once per instance. Split from
policies/estimate.py, whose estimate_prefill and prefix_plan it reproduces bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from conductor.core.types import InstanceView, RequestView, Tier
from policies.estimate import PrefillEstimate, prefix_plan
from predictors.online import Predictors
from predictors.params import NO_STRETCH


def _plan_sources(sources: Sequence[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The entries of `sources` prefix_plan can use for any instance, in their order: per link
    the first, and the first from another source than that (the one prefix_plan takes on the
    first's own instance). prefix_plan only ever tries the first entry per link that is not the
    instance's own, so its plan is the same from these as from all of `sources`, with a
    fraction of the walk: every instance holding a prefix is a source and has its own plan."""
    firsts: dict[str, str] = {}  # link -> source of its first entry
    seconds: set[str] = set()  # links whose first entry from another source is kept too
    out = []
    for entry in sources:
        _, src, link = entry
        first = firsts.get(link)
        if first is None:
            firsts[link] = src
        elif link in seconds or src == first:
            continue
        else:
            seconds.add(link)
        out.append(entry)
    return out


class PoolPrefillEstimates:
    """estimate_prefill for every instance of a pool, made no more often than it can differ.

    An instance that neither holds a prefix of the request (in `request.cached`) nor is a pull
    source gets the same prefix plan as every other such instance (local prefix 0, the same
    sources): its predicted TTFT differs from theirs only by its own queue. So the plan is made
    once and each of those instances costs one queue estimate, not a walk over the sources. The
    others get their own plan. A PrefillEstimate is built only for the instances a decision lists
    (`estimate(i)`): most are weighed and dropped. `ttfts[i]` is bit for bit
    estimate_prefill(...).ttft_s of `prefills[i]` (the same float operations in the same order) and
    `estimate(i)` an equal PrefillEstimate.

    On mixed workers (not `disaggregated`) each one's queue and prefill carry the stretch of the
    streams listed there (Predictors.mixed_stretch): its own, so the shared plan's prefill is
    stretched per worker (`_prefill`).
    """

    __slots__ = ("_built", "_handoff", "_n", "_plan", "_plans", "_queues", "_stretches", "prefills", "ttfts")

    def __init__(
        self,
        pred: Predictors,
        request: RequestView,
        prefills: tuple[InstanceView, ...],
        sources: list[tuple[int, str, str]],
        *,
        allow_pull: bool,
        disaggregated: bool,
        waits: Mapping[str, float] | None = None,
    ) -> None:
        n = max(1, request.prompt_tokens)
        self.prefills = prefills
        usable = _plan_sources(sources) if allow_pull else ()
        self._plan = transfer, prefill, _, _, _ = prefix_plan(pred, n, 0, usable, None, waits)
        self._handoff = handoff = pred.transfer_s(n) if disaggregated else 0.0
        # an instance named like a source (the store's "store" included) skips that source: its own plan
        singular = request.cached.keys() | ({s[1] for s in sources} if allow_pull else set())
        queue_s = pred.queue_s
        self._n = n
        self._stretches = None if disaggregated else [pred.mixed_stretch(inst) for inst in prefills]
        if self._stretches is None or all(st is NO_STRETCH for st in self._stretches):
            self._stretches = None  # no stream shares any worker's engine (or nothing learned): the plain sums
            self._queues = queues = [queue_s(inst.prefill_queue) for inst in prefills]
            self.ttfts = [transfer + queue + prefill + handoff for queue in queues]  # estimate_prefill's sum, in its order
        else:
            stretches = self._stretches
            self._queues = queues = [queue_s(inst.prefill_queue, st) for inst, st in zip(prefills, stretches, strict=True)]
            self.ttfts = [transfer + queue + self._prefill(prefill, 0, i) + handoff for i, queue in enumerate(queues)]
        self._plans: dict[int, tuple[float, float, int, int, str | None]] = {}
        self._built: dict[int, PrefillEstimate] = {}  # estimate(i) as built: a decision asks for the best twice
        # a plan is a function of the local prefix and of the instance only where it is one of the
        # sources prefix_plan would try: instances alike there (a prefix every one holds, say) share it
        tried = {s[1] for s in usable}
        plans: dict[tuple[int, str | None], tuple[float, float, int, int, str | None]] = {(0, None): self._plan}
        cached, own_plans, ttfts, last = request.cached, self._plans, self.ttfts, n - 1
        for i, inst in enumerate(prefills):
            iid = inst.id
            if iid in singular:
                own = cached.get(iid)  # _local_prefix, inline: it runs for nearly every instance
                local = 0 if own is None or own.tier is Tier.STORE else (own.tokens if own.tokens < last else last)
                key = (local, iid if iid in tried else None)
                plan = plans.get(key)
                if plan is None:
                    plan = plans[key] = prefix_plan(pred, n, local, usable, key[1], waits)
                own_plans[i] = plan
                ttfts[i] = plan[0] + queues[i] + self._prefill(plan[1], plan[2], i) + handoff

    @property
    def handoff_s(self) -> float:
        """The predicted P->D handoff of the request's KV, the same on every instance (0 mixed)."""
        return self._handoff

    def _prefill(self, prefill: float, prefix: int, i: int) -> float:
        """A plan's prefill of the request on instance `i`, with its stretch (NO_STRETCH: as is)."""
        stretches = self._stretches
        if stretches is None:
            return prefill
        s0, s1 = stretches[i]
        return prefill + (s0 + s1 * (self._n - prefix))

    def works(self) -> list[float]:
        """Each instance's own prefill compute (`PrefillEstimate.prefill_s`): what placing the
        request there takes from the pool's capacity, pulls and its cached prefix excluded."""
        shared, plans = self._plan, self._plans
        return [self._prefill(plans.get(i, shared)[1], plans.get(i, shared)[2], i) for i in range(len(self.prefills))]

    def estimate(self, i: int) -> PrefillEstimate:
        est = self._built.get(i)
        if est is not None:
            return est
        transfer, prefill, prefix, pulled, source = self._plans.get(i) or self._plan
        est = self._built[i] = PrefillEstimate(
            instance=self.prefills[i],
            ttft_s=self.ttfts[i],
            transfer_s=transfer,
            queue_s=self._queues[i],
            prefill_s=self._prefill(prefill, prefix, i),
            handoff_s=self._handoff,
            cached_tokens=prefix,
            pulled_tokens=pulled,
            pull_from=source,
        )
        return est
