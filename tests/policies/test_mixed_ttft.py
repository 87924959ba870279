"""kvcache_aware's TTFT on mixed workers (issue 39): a prefill beside decoding streams takes longer
(their tokens ride in each chunk's step, their KV slows the steps); what the streams listed at
decision time add is learned from the workers' observed first tokens and predicted."""

from __future__ import annotations

import random

import pytest

from conductor.core.types import ActiveDecode, InstanceView, Observation, Role
from policies.kvcache_aware import KvCacheAwarePolicy
from predictors import OnlineConfig, Predictors, bundled_profile, fit_profiles
from tests.policies.cluster_builders import request, routed, snapshot


def _truth(n: int, resident: int) -> float:
    """A worker 3x slower than the bundled profile, stretched by its streams' KV."""
    base = 3.0 * (0.045 + 2.0e-5 * n + 4.6e-11 * n * n)
    return base * (1.0 + resident / 30_000)


def _worker(iid: str, streams: int) -> InstanceView:
    return InstanceView(iid, Role.MIXED, decodes=tuple(ActiveDecode(4000, 32) for _ in range(streams)))


def test_mixed_ttft_learns_the_streams_sharing_the_worker() -> None:
    pol = KvCacheAwarePolicy(predictors=Predictors(fit_profiles([bundled_profile()]), OnlineConfig()))
    rng = random.Random(3)
    for i in range(160):
        n, streams = rng.randint(1024, 6144), rng.randint(0, 8)
        # one worker, so the decision is on the worker whose streams are listed
        req = request(n, rid=f"r{i}")
        d = routed(pol, req, snapshot(_worker("m0", streams)))
        assert d.prefill == "m0" and d.decode is None
        ttft = _truth(n, streams * 4000) * rng.lognormvariate(0.0, 0.03)
        pol.observe(Observation(req.request_id, "m0", None, n, 0, 0, None, ttft, output_tokens=0))
    for streams in (0, 4, 8):
        d = pol.decide(request(4096, rid=f"q{streams}"), snapshot(_worker("m0", streams)))
        assert d.predicted_ttft_s == pytest.approx(_truth(4096, streams * 4000), rel=0.08)
