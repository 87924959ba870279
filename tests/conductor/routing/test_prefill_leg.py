"""The gateway tells a PrefillLegObserver policy each prefill leg as soon as the prefill answered
(NIXL: before the decode leg starts), and the request's Observation after it, with the same leg."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from conductor.core.types import ClusterSnapshot, Decision, Observation, PrefillLeg, RequestView, Role
from policies.base import BasePolicy
from policies.registry import load_policy
from tests.support.cluster import cluster


class _Recording(BasePolicy):
    name = "recording"

    def __init__(self, fail_on_leg: bool = False) -> None:
        self.events: list[tuple[str, PrefillLeg | Observation]] = []
        self.fail_on_leg = fail_on_leg

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        pools = cluster.by_role(Role.PREFILL), cluster.by_role(Role.DECODE), cluster.by_role(Role.MIXED)
        if pools[2]:
            return Decision(request.request_id, self.name, prefill=pools[2][0].id)
        return Decision(request.request_id, self.name, prefill=pools[0][0].id, decode=pools[1][0].id)

    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        self.events.append(("leg", leg))
        if self.fail_on_leg:
            raise RuntimeError("a policy bug")

    def observe(self, observation: Observation) -> None:
        self.events.append(("observation", observation))


def test_each_leg_comes_before_its_observation_with_the_same_figures() -> None:
    policy = _Recording()
    with cluster("nixl", policy=policy, standin={"prefill": {"cached_tokens": 7}}) as c:
        plain = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "abcd" * 20, "max_tokens": 3})
        streamed = httpx.post(
            c.url + "/v1/completions", json={"model": "tiny", "prompt": "wxyz" * 20, "max_tokens": 3, "stream": True}
        )
        assert plain.status_code == 200 and streamed.status_code == 200
    kinds = [kind for kind, _ in policy.events]
    assert kinds == ["leg", "observation", "leg", "observation"]
    for (_, leg), (_, obs) in zip(policy.events[::2], policy.events[1::2], strict=True):
        assert isinstance(leg, PrefillLeg) and isinstance(obs, Observation)
        assert leg.request_id == obs.request_id
        assert leg.prefill == obs.prefill and obs.decode is not None
        assert leg.prompt_tokens == obs.prompt_tokens > 0
        assert leg.cached_tokens == 7  # what the prefill worker reported
        assert obs.queue_and_prefill_s is not None
        assert leg.queue_and_prefill_s == obs.queue_and_prefill_s > 0


def test_mixed_workers_have_no_separate_leg() -> None:
    policy = _Recording()
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, policy=policy) as c:
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "abcd", "max_tokens": 3})
        assert r.status_code == 200
    assert [kind for kind, _ in policy.events] == ["observation"]


def test_a_failing_leg_observer_fails_no_request() -> None:
    policy = _Recording(fail_on_leg=True)
    with cluster("nixl", policy=policy) as c:
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "abcd", "max_tokens": 3})
        assert r.status_code == 200, r.text
    assert [kind for kind, _ in policy.events] == ["leg", "observation"]


def test_kvcache_aware_learns_the_leg_once() -> None:
    """The leg is learned when it is told; the Observation after it teaches the decode leg and the
    TBT, not the prefill leg again (each would be a second sample of one leg in the prefill fit)."""
    policy = load_policy("kvcache_aware", {"admission": "none"})
    lessons = policy.predictors.record_lessons()  # type: ignore[attr-defined]
    with cluster("nixl", policy=policy) as c:
        for i in range(3):
            r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": f"{i}" * 50, "max_tokens": 3})
            assert r.status_code == 200, r.text
    legs = [lesson for lesson in lessons if lesson[0] == "leg"]
    assert len(legs) == 3


class _QueueWatcher(_Recording):
    """Records the prefill instance's queue each decision sees; tells when a leg is learned."""

    def __init__(self) -> None:
        super().__init__()
        self.queues: list[int] = []
        self.leg_seen = threading.Event()
        self.decided = threading.Event()

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.queues.append(len(cluster.by_role(Role.PREFILL)[0].prefill_queue))
        self.decided.set()
        return super().decide(request, cluster)

    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        super().observe_prefill_leg(leg)
        self.leg_seen.set()


def test_a_prefill_that_answered_leaves_the_queue_before_its_decode_answers() -> None:
    # a non-streamed decode answers at its last token: the prefill instance's queue must not hold the
    # request that long (later decisions would predict a wait behind a prefill long over)
    policy, release = _QueueWatcher(), threading.Event()
    body = {"model": "tiny", "prompt": "abcd" * 20, "max_tokens": 3}
    with cluster("nixl", policy=policy, standin={"decode": {"answer_after": release}}) as c, ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, c.url + "/v1/completions", json=body, timeout=30)
        assert policy.leg_seen.wait(30)  # its prefill answered; its decode is held
        policy.decided.clear()
        second = pool.submit(httpx.post, c.url + "/v1/completions", json=body, timeout=30)
        assert policy.decided.wait(30)
        release.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
    assert policy.queues == [0, 0]  # the first request's entry was gone when the second was placed
