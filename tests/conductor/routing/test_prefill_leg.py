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


def test_a_non_streamed_mixed_answer_tells_no_leg() -> None:
    # it shows no first token (the whole answer comes at once): only its Observation is told
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


class _LegWatcher(_Recording):
    """Tells when a leg is learned."""

    def __init__(self) -> None:
        super().__init__()
        self.leg_seen = threading.Event()

    def observe_prefill_leg(self, leg: PrefillLeg) -> None:
        super().observe_prefill_leg(leg)
        self.leg_seen.set()


def test_a_mixed_streams_leg_is_told_at_its_first_token() -> None:
    """A mixed worker has no prefill answer: its stream's first token ends the leg, told then, while
    the rest of the stream is held (the worker sends token k+1 only when released), with the TTFT
    its Observation repeats. Told at the stream's end instead, a surge was learned seconds late."""
    policy, gate = _LegWatcher(), threading.Semaphore(0)
    body = {"model": "tiny", "prompt": "abcd" * 20, "max_tokens": 4, "stream": True}
    with (
        cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, policy=policy, standin={"mixed": {"token_gate": gate}}) as c,
        httpx.Client(base_url=c.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        chunks = r.iter_raw()
        next(chunks)  # the first token reached the client; the worker holds the second
        assert policy.leg_seen.wait(30)
        assert [kind for kind, _ in policy.events] == ["leg"]  # told before the stream is over
        gate.release(3)
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert [kind for kind, _ in policy.events] == ["leg", "observation"]
    (_, leg), (_, obs) = policy.events
    assert isinstance(leg, PrefillLeg) and isinstance(obs, Observation)
    assert (leg.request_id, leg.prefill, obs.decode) == (obs.request_id, obs.prefill, None)
    assert leg.prompt_tokens == obs.prompt_tokens > 0
    assert leg.cached_tokens is None  # the worker reports them with its last chunk
    assert obs.queue_and_prefill_s is None and obs.ttft_s is not None
    assert leg.queue_and_prefill_s == obs.ttft_s > 0


def test_kvcache_aware_learns_a_mixed_leg_once_at_the_first_token() -> None:
    """The mixed leg is learned when the first token is told, before the stream ends; the
    Observation teaches the TBT, not a second sample of the leg."""
    policy = load_policy("kvcache_aware", {"admission": "none"})
    lessons = policy.predictors.record_lessons()  # type: ignore[attr-defined]
    gate = threading.Semaphore(0)
    body = {"model": "tiny", "prompt": "abcd" * 20, "max_tokens": 3, "stream": True}
    with (
        cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, policy=policy, standin={"mixed": {"token_gate": gate}}) as c,
        httpx.Client(base_url=c.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        chunks = r.iter_raw()
        next(chunks)  # first token here, the second held: learned already
        assert [lesson[0] for lesson in lessons] == ["mixed_leg"]
        gate.release(2)
        b"".join(chunks)
    assert [lesson[0] for lesson in lessons] == ["mixed_leg", "tbt"]  # the leg not again at the end


class _HeadWatcher(_Recording):
    """Records, per decision, whether the mixed worker's queue head will show its prefill's end."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[bool | None] = []
        self.decided = threading.Event()

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        queue = cluster.by_role(Role.MIXED)[0].prefill_queue
        self.heads.append(queue[0].end_seen if queue else None)
        self.decided.set()
        return super().decide(request, cluster)


def test_a_non_streamed_request_on_a_mixed_worker_is_queued_as_one_whose_end_is_not_seen() -> None:
    # its prefill's end is invisible (the answer comes whole): predictors/overrun.py must not read
    # its elapsed time as a prefill's; a stream's first token shows it, so its entry may be read
    policy = _HeadWatcher()
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, policy=policy) as c, ThreadPoolExecutor(2) as pool:
        for stream in (False, True):
            release = threading.Event()
            c.mixed[0].answer_after = release
            body = {"model": "tiny", "prompt": "abcd" * 20, "max_tokens": 3, "stream": stream}
            held = pool.submit(httpx.post, c.url + "/v1/completions", json=body, timeout=30)
            assert c.mixed[0].arrived.wait(30)  # the held request reached the worker
            c.mixed[0].arrived.clear()
            policy.decided.clear()
            probe = pool.submit(httpx.post, c.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
            assert policy.decided.wait(30)
            release.set()
            assert held.result().status_code == 200 and probe.result().status_code == 200
            c.mixed[0].arrived.clear()
    assert policy.heads == [None, False, None, True]
