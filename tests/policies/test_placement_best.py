"""placement_best is min() over placement_rank, first of equals included."""

from __future__ import annotations

import random
from typing import cast

from policies.kvcache_aware.placement import placement_best, placement_rank
from policies.kvcache_aware.pool_estimates import PoolPrefillEstimates


class _Weighed:
    def __init__(self, ttfts: list[float], works: list[float], handoff: float) -> None:
        self.ttfts, self._works, self.handoff_s = ttfts, works, handoff

    def works(self) -> list[float]:
        return self._works


def test_placement_best_is_the_min_of_the_ranks() -> None:
    rng = random.Random(11)
    for _ in range(20_000):
        n = rng.randint(1, 10)
        shared = rng.choice((0.5, 1.0))  # one object for many instances, as PoolPrefillEstimates.works gives
        ttfts = [rng.choice((1.0, 2.0, rng.uniform(0, 3))) for _ in range(n)]
        works = [shared if rng.random() < 0.5 else rng.choice((0.5, 1.0, rng.uniform(0, 1))) for _ in range(n)]
        weighed = cast(PoolPrefillEstimates, _Weighed(ttfts, works, rng.choice((0.0, 0.25))))
        for limit in (None, rng.uniform(0, 3), 1.0, 0.75):
            assert placement_best(limit, weighed) == min(range(n), key=placement_rank(limit, weighed))


def test_lowest_load_and_one_listed_are_the_min_they_replace() -> None:
    from policies.base import listed_indices
    from policies.kvcache_aware.placement import lowest_load

    rng = random.Random(13)
    for _ in range(20_000):
        n = rng.randint(1, 9)
        shared = rng.choice((0.5, 1.0))
        tbts = [rng.choice((0.02, 0.03, shared, rng.uniform(0, 0.05))) for _ in range(n)]
        batches = [rng.choice((1.0, 2.0, shared)) for _ in range(n)]
        assert lowest_load(tbts, batches) == min(zip(tbts, batches, range(n), strict=True))[2]
        chosen = rng.randrange(n)
        best = min(range(n), key=tbts.__getitem__)
        assert listed_indices(tbts, 1, chosen) == ([best] if best == chosen else sorted((best, chosen)))
