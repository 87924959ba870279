"""llm-d's inference scheduler: a weighted sum of normalised scorers, highest total wins.

Scorers, as in llm-d / gateway-api-inference-extension, each in [0, 1]:

* queue (weight 2): min-max normalised waiting-queue depth, (max - q) / (max - min); 1 for every
  worker when all queues are equal. Depth is the worker's scraped `vllm:num_requests_waiting`
  (`InstanceView.waiting_requests`) when known, else the gateway's own count of queued prefills.
* KV-cache utilisation (weight 2): 1 - usage, from the scraped `vllm:kv_cache_usage_perc`
  (`kv_usage`), else resident decode KV / capacity, else 0 usage.
* prefix cache (weight 3): matched blocks / prompt blocks, on llm-d's 64-token blocks; the match is
  the leading tokens the cache index says the worker holds (llm-d's precise, KV-event-fed index).

The max-score picker breaks ties at random (seeded here). Both pools are scored the same way, as
llm-d's prefill and decode scheduling profiles do by default. llm-d's decider that skips P/D for
short uncached prompts is not rendered: a disaggregated Conductor cluster always runs both legs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from conductor.core.types import CandidateScore, ClusterSnapshot, Decision, InstanceView, RequestView
from policies.admission import BaselineAdmission
from policies.base import BasePolicy, check_listed, decided, listed_indices, local_prefix, missing_pool, pools, request_rng

LLMD_BLOCK = 64  # tokens per block in llm-d's prefix index


def queue_depth(inst: InstanceView) -> int:
    return inst.waiting_requests if inst.waiting_requests is not None else len(inst.prefill_queue)


def kv_usage(inst: InstanceView) -> float:
    if inst.kv_usage is not None:
        return min(1.0, max(0.0, inst.kv_usage))
    if inst.kv_capacity_tokens:
        return min(1.0, inst.resident_kv_tokens / inst.kv_capacity_tokens)
    return 0.0


class LlmdPolicy(BasePolicy):
    name = "llmd"

    def __init__(
        self,
        queue_weight: float = 2.0,
        kv_cache_weight: float = 2.0,
        prefix_weight: float = 3.0,
        seed: int | None = 0,
        admission: str = "none",
        predictor_params: str | None = None,
        listed_candidates: int | None = None,
    ) -> None:
        """`listed_candidates`: how many instances of each pool a decision lists in `candidates`
        (policies.base.check_listed; None: every one)."""
        self.listed_candidates = check_listed(listed_candidates)
        self.weights = (queue_weight, kv_cache_weight, prefix_weight)
        self.seed = seed
        self._guard = BaselineAdmission(admission, predictor_params)

    def scores(self, request: RequestView, pool: Sequence[InstanceView]) -> list[tuple[float, float, float]]:
        """(queue, kv, prefix) scorer values for each worker in the pool."""
        depths = [queue_depth(i) for i in pool]
        lo, hi = min(depths), max(depths)
        blocks = max(1, math.ceil(request.prompt_tokens / LLMD_BLOCK))
        out = []
        for inst, q in zip(pool, depths, strict=True):
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            prefix = (local_prefix(request, inst.id) // LLMD_BLOCK) / blocks
            out.append((queue, 1.0 - kv_usage(inst), prefix))
        return out

    def pick(
        self, request: RequestView, pool: Sequence[InstanceView], draw: int = 0
    ) -> tuple[InstanceView, list[CandidateScore]]:
        wq, wk, wp = self.weights
        scores = self.scores(request, pool)
        totals = [wq * q + wk * k + wp * p for q, k, p in scores]
        best = max(totals)
        ties = [i for i, t in enumerate(totals) if t == best]
        chosen = ties[0] if len(ties) == 1 else request_rng(self.seed, request, draw).choice(ties)
        cands = []
        for i in listed_indices([-t for t in totals], self.listed_candidates, chosen):
            q, k, p = scores[i]
            # CandidateScore.score is lower-is-better: store the negated total
            cands.append(CandidateScore(pool[i].id, pool[i].role, -totals[i], detail={"queue": q, "kv_cache": k, "prefix": p}))
        return pool[chosen], cands

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill, decode, disaggregated = pools(cluster)
        missing = missing_pool(request, self.name, prefill, decode, disaggregated)
        if missing is not None:
            return missing
        p, p_cands = self.pick(request, prefill)
        d_id: str | None = None
        d_cands: list[CandidateScore] = []
        if disaggregated:
            d, d_cands = self.pick(request, decode, 1)
            d_id = d.id
        candidates = tuple(p_cands) + tuple(d_cands)
        unlisted = len(prefill) + len(decode) - len(candidates)
        return decided(request, self.name, p.id, d_id, candidates, self._guard.check(request, cluster, p.id, d_id), unlisted)
