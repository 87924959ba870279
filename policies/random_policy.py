"""Random: a uniformly random prefill and decode instance (FAST'25 Fig. 5's "Random" baseline).

Seeded, so a simulation replays the same choices; `seed=None` draws from the OS.
"""

from __future__ import annotations

import random

from policies.admission import BaselineAdmission
from policies.base import BasePolicy, decided, missing_pool, pools
from policies.types import ClusterSnapshot, Decision, RequestView


class RandomPolicy(BasePolicy):
    name = "random"

    def __init__(
        self, seed: int | None = 0, admission: str = "none", predictor_params: str | None = None
    ) -> None:
        self._rng = random.Random(seed)
        self._guard = BaselineAdmission(admission, predictor_params)

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        prefill, decode, disaggregated = pools(cluster)
        missing = missing_pool(request, self.name, prefill, decode, disaggregated)
        if missing is not None:
            return missing
        p = self._rng.choice(prefill).id
        d = self._rng.choice(decode).id if disaggregated else None
        return decided(request, self.name, p, d, rejection=self._guard.check(request, cluster, p, d))
