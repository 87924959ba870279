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
from policies.base import BasePolicy, decided, missing_pool, pools, request_rng


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

    def __init__(self, admission: str = "none", predictor_params: str | None = None) -> None:
        self._guard = BaselineAdmission(admission, predictor_params)

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill, decode, disaggregated = pools(cluster)
        missing = missing_pool(request, self.name, prefill, decode, disaggregated)
        if missing is not None:
            return missing
        p = min(prefill, key=prefill_load)
        d = min(decode, key=decode_load) if disaggregated else None
        candidates = tuple(CandidateScore(i.id, i.role, float(i.queued_prefill_tokens)) for i in prefill) + tuple(
            CandidateScore(i.id, i.role, float(len(i.decodes))) for i in decode
        )
        d_id = d.id if d is not None else None
        return decided(request, self.name, p.id, d_id, candidates, self._guard.check(request, cluster, p.id, d_id))
