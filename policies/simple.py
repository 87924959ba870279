"""The two simplest baselines of FAST'25 Fig. 5: "Random" and "Load balancing".

* `random`: a uniformly random prefill and decode instance. Seeded, so a simulation replays the
  same choices; `seed=None` draws from the OS.
* `least_loaded`: "the instance with the lightest load". Prefill load is the prefill work queued
  there (tokens still to compute), decode load the number of streams; ties go to fewer queued
  requests / less resident KV, then to the earlier instance in the snapshot. Mixed workers weigh
  queued prefill tokens first, then streams.
"""

from __future__ import annotations

from conductor.core.types import CandidateScore, ClusterSnapshot, Decision, InstanceView, RequestView
from policies.admission import BaselineAdmission
from policies.base import BasePolicy, check_listed, decided, listed_indices, missing_pool, pools, request_rng


class RandomPolicy(BasePolicy):
    name = "random"

    def __init__(self, seed: int | None = 0, admission: str = "none", predictor_params: str | None = None) -> None:
        self.seed = seed
        self._guard = BaselineAdmission(admission, predictor_params)

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill, decode, disaggregated = pools(cluster)
        missing = missing_pool(request, self.name, prefill, decode, disaggregated)
        if missing is not None:
            return missing
        rng = request_rng(self.seed, request)
        p = rng.choice(prefill).id
        d = rng.choice(decode).id if disaggregated else None
        return decided(request, self.name, p, d, rejection=self._guard.check(request, cluster, p, d))


def prefill_load(inst: InstanceView) -> tuple[int, int, int]:
    return (inst.queued_prefill_tokens, len(inst.prefill_queue), len(inst.decodes))


def decode_load(inst: InstanceView) -> tuple[int, int]:
    return (len(inst.decodes), inst.resident_kv_tokens)


class LeastLoadedPolicy(BasePolicy):
    name = "least_loaded"

    def __init__(
        self, admission: str = "none", predictor_params: str | None = None, listed_candidates: int | None = None
    ) -> None:
        """`listed_candidates`: how many instances of each pool a decision lists in `candidates`
        (policies.base.check_listed; None: every one)."""
        self.listed_candidates = check_listed(listed_candidates)
        self._guard = BaselineAdmission(admission, predictor_params)

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill, decode, disaggregated = pools(cluster)
        missing = missing_pool(request, self.name, prefill, decode, disaggregated)
        if missing is not None:
            return missing
        keep = self.listed_candidates
        p_loads = [prefill_load(i) for i in prefill]
        p_i = min(range(len(prefill)), key=p_loads.__getitem__)  # the first of equals, as min(prefill, ...)
        p = prefill[p_i]
        p_scores = [float(load[0]) for load in p_loads]
        candidates = tuple(
            CandidateScore(prefill[k].id, prefill[k].role, p_scores[k]) for k in listed_indices(p_scores, keep, p_i)
        )
        d_id = None
        if disaggregated:
            d_i = min(range(len(decode)), key=lambda k: decode_load(decode[k]))
            d_id = decode[d_i].id
            d_scores = [float(len(i.decodes)) for i in decode]
            candidates += tuple(
                CandidateScore(decode[k].id, decode[k].role, d_scores[k]) for k in listed_indices(d_scores, keep, d_i)
            )
        unlisted = len(prefill) + len(decode) - len(candidates)
        return decided(request, self.name, p.id, d_id, candidates, self._guard.check(request, cluster, p.id, d_id), unlisted)
