"""NVIDIA Dynamo's KV router cost (lib/kv-router/src/scheduling/selector/default.rs, `worker_logit`).

For each worker, in blocks of `block_size` tokens:

    overlap_credit = overlap_score_credit * device_overlap + host_cache_hit_weight * host_overlap
                     + disk_cache_hit_weight * store_overlap_beyond_device
    cost = prefill_load_scale * max(active_prefill_blocks + prompt_blocks - overlap_credit, 0)
           + active_decode_blocks + new_blocks

with defaults prefill_load_scale 1, overlap_score_credit 1, host 0.75, disk 0.25. Dynamo's
`raw_prefill_blocks` is the worker's queued prefill plus this request's prompt; `decode_cost_blocks`
is its active decode blocks plus the blocks this request would newly allocate there (prompt blocks
not already on the device). The pooled store is treated as Dynamo's disk/shared tier (0.25 credit
for the part of the prefix beyond what the worker holds). Temperature 0 takes the argmin (ties
broken at random, seeded); above 0 it samples from softmax(-normalised cost / temperature), costs
min-max normalised first, as Dynamo's `softmax_sample_index` does.

Decode pool (P/D): Dynamo's decode router forces overlap credit to 0, leaving
cost = active_decode_blocks + new_blocks, i.e. the least decode KV load.
"""

from __future__ import annotations

import math

from conductor.core.types import CandidateScore, ClusterSnapshot, Decision, InstanceView, RequestView, Tier
from policies.admission import BaselineAdmission
from policies.base import BasePolicy, check_listed, decided, listed_indices, missing_pool, pools, request_rng


class DynamoKvPolicy(BasePolicy):
    name = "dynamo_kv"

    def __init__(
        self,
        prefill_load_scale: float = 1.0,
        overlap_score_credit: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
        temperature: float = 0.0,
        seed: int | None = 0,
        admission: str = "none",
        predictor_params: str | None = None,
        listed_candidates: int | None = None,
    ) -> None:
        """`listed_candidates`: how many instances of each pool a decision lists in `candidates`
        (policies.base.check_listed; None: every one)."""
        self.listed_candidates = check_listed(listed_candidates)
        self.prefill_load_scale = prefill_load_scale
        self.overlap_score_credit = overlap_score_credit
        self.host_cache_hit_weight = host_cache_hit_weight
        self.disk_cache_hit_weight = disk_cache_hit_weight
        self.temperature = temperature
        self.seed = seed
        self._guard = BaselineAdmission(admission, predictor_params)

    def prefill_cost(self, request: RequestView, inst: InstanceView) -> float:
        bs = request.block_size
        prompt_blocks = math.ceil(request.prompt_tokens / bs)
        own = request.cached.get(inst.id)
        device = own.tokens // bs if own is not None and own.tier is Tier.DEVICE else 0
        host = own.tokens // bs if own is not None and own.tier is Tier.HOST else 0
        store_beyond = max(0, request.store_cached_tokens // bs - device - host)
        credit = (
            self.overlap_score_credit * device + self.host_cache_hit_weight * host + self.disk_cache_hit_weight * store_beyond
        )
        active_prefill = math.ceil(inst.queued_prefill_tokens / bs)
        return self.prefill_load_scale * max(active_prefill + prompt_blocks - credit, 0.0) + self.decode_cost(
            request, inst, device
        )

    @staticmethod
    def decode_cost(request: RequestView, inst: InstanceView, device_overlap_blocks: int = 0) -> float:
        bs = request.block_size
        active = sum(math.ceil(d.context_tokens / bs) for d in inst.decodes)
        return float(active + max(0, math.ceil(request.prompt_tokens / bs) - device_overlap_blocks))

    def pick(self, costs: list[float], request: RequestView, draw: int) -> int:
        """The index Dynamo's selector takes; `draw` tells this request's random choices apart."""
        lo, hi = min(costs), max(costs)
        if self.temperature <= 0:
            ties = [k for k, c in enumerate(costs) if c == lo]
            return ties[0] if len(ties) == 1 else request_rng(self.seed, request, draw).choice(ties)
        if hi == lo:
            return request_rng(self.seed, request, draw).randrange(len(costs))
        weights = [math.exp(-(c - lo) / ((hi - lo) * self.temperature)) for c in costs]
        return request_rng(self.seed, request, draw).choices(range(len(costs)), weights=weights)[0]

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill, decode, disaggregated = pools(cluster)
        missing = missing_pool(request, self.name, prefill, decode, disaggregated)
        if missing is not None:
            return missing
        keep = self.listed_candidates
        p_costs = [self.prefill_cost(request, i) for i in prefill]
        p_i = self.pick(p_costs, request, 0)
        p = prefill[p_i].id
        d_costs = [self.decode_cost(request, i) for i in decode]
        d, listed_d = None, []
        if disaggregated:
            d_i = self.pick(d_costs, request, 1)
            d, listed_d = decode[d_i].id, listed_indices(d_costs, keep, d_i)
        candidates = tuple(
            CandidateScore(prefill[k].id, prefill[k].role, p_costs[k]) for k in listed_indices(p_costs, keep, p_i)
        ) + tuple(CandidateScore(decode[k].id, decode[k].role, d_costs[k]) for k in listed_d)
        unlisted = len(prefill) + len(decode) - len(candidates)
        return decided(request, self.name, p, d, candidates, self._guard.check(request, cluster, p, d), unlisted)
