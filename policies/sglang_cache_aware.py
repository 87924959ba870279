"""sglang-router's `cache_aware` policy (sgl-router/src/policies/cache_aware.rs), rendered faithfully
except where Conductor sees the cluster differently (each approximation is named below).

Per request, over the prefill-capable pool:

1. Load is each worker's count of requests in flight from the router (sglang: `worker.load()`).
   Here: prefill entries queued (plus decode streams for mixed workers), from the snapshot.
2. If the pool is imbalanced -- `max - min > balance_abs_threshold` (64) and
   `max > balance_rel_threshold * min` (1.5) -- route to the least loaded worker.
3. Otherwise find the worker with the longest prefix match. sglang matches the request *text*
   against an approximate radix tree of what it routed to each worker; here the match is the
   leading tokens the cache index says each instance holds (`RequestView.cached`, device or host
   tier), and the match ratio is matched tokens / prompt tokens. If the ratio > `cache_threshold`
   (0.3), route there.
4. Else route to the worker with the smallest tree ("most available cache capacity"). The policy
   keeps sglang's per-worker tree size itself: tokens it inserted there (prompt minus what matched),
   each worker capped at `max_tree_size` as sglang's periodic `evict_tenant_by_size` does.

Decode (P/D): least load, i.e. fewest decode streams, as sglang's `select_worker_pair` does.
"""

from __future__ import annotations

from conductor.core.types import CandidateScore, ClusterSnapshot, Decision, InstanceView, RequestView
from policies.admission import BaselineAdmission
from policies.base import BasePolicy, check_listed, decided, listed_indices, local_prefix, missing_pool, pools

MAX_TRACKED = 4096  # instances whose tree size is kept; more means stale ids piling up


def _load(inst: InstanceView) -> int:
    return len(inst.prefill_queue) + len(inst.decodes)


class SglangCacheAwarePolicy(BasePolicy):
    name = "sglang_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**26,
        admission: str = "none",
        predictor_params: str | None = None,
        listed_candidates: int | None = None,
    ) -> None:
        """`listed_candidates`: how many prefill instances a decision lists in `candidates`
        (policies.base.check_listed; None: every one)."""
        self.listed_candidates = check_listed(listed_candidates)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._tree_size: dict[str, int] = {}
        self._guard = BaselineAdmission(admission, predictor_params)

    def imbalanced(self, loads: list[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def select(self, request: RequestView, pool: tuple[InstanceView, ...]) -> tuple[InstanceView, str]:
        """The worker sglang would pick, and which rule picked it."""
        loads = [_load(i) for i in pool]
        if self.imbalanced(loads):
            return pool[loads.index(min(loads))], "shortest_queue"
        matches = [local_prefix(request, i.id) for i in pool]
        best = max(range(len(pool)), key=lambda k: matches[k])
        ratio = matches[best] / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
        if ratio > self.cache_threshold:
            return pool[best], "cache_match"
        return min(pool, key=lambda i: self._tree_size.get(i.id, 0)), "smallest_tree"

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill, decode, disaggregated = pools(cluster)
        missing = missing_pool(request, self.name, prefill, decode, disaggregated)
        if missing is not None:
            return missing
        chosen, _rule = self.select(request, prefill)
        d = min(decode, key=lambda i: len(i.decodes)).id if disaggregated else None
        loads = [float(_load(i)) for i in prefill]
        chosen_i = next(k for k, i in enumerate(prefill) if i is chosen)
        candidates = tuple(
            CandidateScore(
                prefill[k].id,
                prefill[k].role,
                loads[k],
                detail={
                    "matched_tokens": float(local_prefix(request, prefill[k].id)),
                    "tree_tokens": float(self._tree_size.get(prefill[k].id, 0)),
                },
            )
            for k in listed_indices(loads, self.listed_candidates, chosen_i)
        )
        return decided(
            request,
            self.name,
            chosen.id,
            d,
            candidates,
            self._guard.check(request, cluster, chosen.id, d),
            len(prefill) - len(candidates),
        )

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        """The one state it keeps: each worker's approximate radix-tree size (tokens routed there
        and not already cached), which sglang's router uses to break ties when no cache matches."""
        if decision.prefill is not None and not decision.rejected:
            self._insert(decision.prefill, request.prompt_tokens - local_prefix(request, decision.prefill), cluster)

    def _insert(self, instance_id: str, tokens: int, cluster: ClusterSnapshot) -> None:
        size = self._tree_size.get(instance_id, 0) + max(0, tokens)
        self._tree_size[instance_id] = min(size, self.max_tree_size)
        if len(self._tree_size) > MAX_TRACKED:  # forget instances no longer in the cluster
            live = {i.id for i in cluster.instances}
            self._tree_size = {k: v for k, v in self._tree_size.items() if k in live}
