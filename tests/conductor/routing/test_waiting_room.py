"""A request refused for its TBT waits at the gateway for streams to end, within its TTFT SLO
(conductor/routing/waiting_room.py): through the gateway, in front of a stand-in mixed worker whose
stream the test holds and lets go."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest

from conductor.config.groups import HoldSettings
from conductor.core.types import ClusterSnapshot, Decision, Rejection, RequestView, Role, Slo
from conductor.kv.analysis import PromptAnalysis
from conductor.ops.metrics import GatewayMetrics
from conductor.routing.pulls import NO_PULL_OFFER
from conductor.routing.router import Routed
from conductor.routing.waiting_room import WaitingRoom
from policies.admission import TBT_SLO, WAKE_PER_END
from policies.base import BasePolicy
from tests.policies.cluster_builders import request
from tests.support.cluster import Cluster, cluster

STREAM = {"model": "tiny", "prompt": "first", "max_tokens": 3, "stream": True}
SECOND = {"model": "tiny", "prompt": "second", "max_tokens": 2}
ADMITTED = Routed(Decision("r1", "test", prefill="m0"), PromptAnalysis(prompt_tokens=8192, exact=True), request(), NO_PULL_OFFER)


class RefusedWhileStreaming(BasePolicy):
    """The one mixed worker, refused for the TBT while any stream decodes there (as kvcache_aware
    refuses a prefill its streams cannot absorb); what each decision was asked is kept."""

    name = "refused_while_streaming"

    def __init__(self) -> None:
        self.asked: list[float | None] = []  # the TTFT SLO left, per decision asked

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        worker = cluster.by_role(Role.MIXED)[0]
        self.asked.append(request.slo.ttft_s)
        if worker.decodes:
            rejection = Rejection(reason=TBT_SLO, message="the streams cannot absorb it", retry_after_s=1.0)
            return Decision(request.request_id, self.name, rejection=rejection)
        return Decision(request.request_id, self.name, prefill=worker.id)


def _mixed(gate: threading.Semaphore, policy: BasePolicy, **settings: Any) -> AbstractContextManager[Cluster]:
    """One stand-in mixed worker whose streams wait at `gate` after their first token."""
    return cluster(n_prefill=0, n_decode=0, n_mixed=1, policy=policy, standin={"mixed": {"token_gate": gate}}, **settings)


async def _polled(cond: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s  # a bound for a hang, not a speed check
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def _stream(client: httpx.AsyncClient, url: str) -> int:
    async with client.stream("POST", url + "/v1/completions", json=STREAM) as r:
        await r.aread()
    return r.status_code


def _metric(c: Cluster, name: str, labels: dict[str, str] | None = None) -> float:
    value = c.gateway.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def _streaming(c: Cluster, client: httpx.AsyncClient) -> asyncio.Task[int]:
    """The first request, streaming, held after its first token by the worker's gate."""
    first = asyncio.create_task(_stream(client, c.url))
    await _polled(lambda: bool(c.gateway.registry.states["mixed-0"].decodes), "the stream never reached the worker")
    return first


def test_a_request_refused_for_its_tbt_waits_for_the_stream_to_end_and_is_served() -> None:
    gate = threading.Semaphore(0)
    policy = RefusedWhileStreaming()
    with _mixed(gate, policy, slo={"ttft_s": 120.0}) as c:

        async def run() -> tuple[int, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                first = await _streaming(c, client)
                second = asyncio.create_task(client.post(c.url + "/v1/completions", json=SECOND))
                await _polled(lambda: c.gateway.waiting_room.held == 1, "the second request was not held")
                assert not second.done() and not first.done()
                gate.release(10)  # the stream's other tokens: it ends, and the held request is decided again
                return await first, await second

        first_status, second = asyncio.run(run())
    assert first_status == 200
    assert second.status_code == 200, second.text
    assert c.gateway.waiting_room.held == 0
    assert _metric(c, "conductor_hold_seconds_count", {"outcome": "admitted"}) == 1
    assert _metric(c, "conductor_held_requests") == 0
    assert _metric(c, "conductor_rejections_total", {"reason": TBT_SLO}) == 0  # a hold is no refusal
    # the second request was asked about at least twice, the last time with less of its TTFT SLO left
    second_asks = policy.asked[1:]
    assert len(second_asks) >= 2
    assert second_asks[0] == 120.0
    assert second_asks[-1] is not None and second_asks[-1] < 120.0


@pytest.mark.parametrize(
    ("settings", "headers"),
    [
        ({}, {"x-slo-ttft-ms": "200"}),  # 200 ms of TTFT SLO: held, then refused when they are spent
        ({"slo": {"ttft_s": 1e300}, "hold": {"max_wait_s": 0.2}}, {}),  # a TTFT SLO without end: the wait has one
    ],
    ids=["ttft-slo", "max-wait"],
)
def test_a_request_held_past_its_budget_is_refused(settings: dict[str, Any], headers: dict[str, str]) -> None:
    gate = threading.Semaphore(0)
    with _mixed(gate, RefusedWhileStreaming(), **settings) as c:

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(timeout=120) as client:
                first = await _streaming(c, client)
                try:
                    return await client.post(c.url + "/v1/completions", json=SECOND, headers=headers)
                finally:
                    gate.release(10)
                    await first

        second = asyncio.run(run())
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == TBT_SLO
    assert _metric(c, "conductor_hold_seconds_count", {"outcome": "refused"}) == 1
    assert _metric(c, "conductor_rejections_total", {"reason": TBT_SLO}) == 1
    assert c.gateway.waiting_room.held == 0


def test_past_max_held_the_refusal_is_sent_at_once() -> None:
    gate = threading.Semaphore(0)
    with _mixed(gate, RefusedWhileStreaming(), slo={"ttft_s": 120.0}, hold={"max_held": 0}) as c:

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(timeout=120) as client:
                first = await _streaming(c, client)
                try:
                    return await client.post(c.url + "/v1/completions", json=SECOND)
                finally:
                    gate.release(10)
                    await first

        second = asyncio.run(run())
    assert second.status_code == 429
    assert second.json()["error"]["code"] == TBT_SLO
    assert _metric(c, "conductor_hold_seconds_count", {"outcome": "refused"}) == 0  # never held


def test_a_held_request_whose_client_goes_away_leaves_the_room() -> None:
    gate = threading.Semaphore(0)
    policy = RefusedWhileStreaming()
    with _mixed(gate, policy, slo={"ttft_s": 120.0}) as c:

        async def run() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                first = await _streaming(c, client)
                async with httpx.AsyncClient(timeout=120) as other:  # its own connection, closed below
                    second = asyncio.create_task(other.post(c.url + "/v1/completions", json=SECOND))
                    await _polled(lambda: c.gateway.waiting_room.held == 1, "the second request was not held")
                    second.cancel()
                await _polled(lambda: c.gateway.waiting_room.held == 0, "the request stayed held after its client left")
                gate.release(10)
                assert await first == 200

        asyncio.run(run())
    assert _metric(c, "conductor_hold_seconds_count", {"outcome": "cancelled"}) == 1
    assert _metric(c, "conductor_held_requests") == 0


def test_a_stream_end_decides_again_the_longest_waiting_few_not_every_held_request() -> None:
    """WAKE_PER_END per end, the longest waiting first; one not admitted goes to the back."""
    room = WaitingRoom(HoldSettings(), GatewayMetrics())
    asked: list[int] = []
    admit: set[int] = set()

    def decider(n: int) -> Callable[[Slo, bool], Routed | None]:
        def decide(slo: Slo, may_hold: bool) -> Routed | None:
            asked.append(n)
            if n in admit:
                return ADMITTED
            assert may_hold, "the budget of 120 s ran out"
            return None

        return decide

    async def run() -> None:
        tasks = [asyncio.create_task(room.admit(decider(n), Slo(ttft_s=120.0))) for n in range(6)]
        await _polled(lambda: room.held == 6 and len(room._waiters) == 6, "six held")
        asked.clear()
        room.freed()
        await _polled(lambda: len(asked) == WAKE_PER_END and len(room._waiters) == 6, "four decided again")
        assert asked == [0, 1, 2, 3]
        asked.clear()
        admit.update({4, 0})
        room.freed()  # 4 and 5 have waited longest now, then 0 and 1
        await _polled(lambda: len(asked) == WAKE_PER_END and room.held == 4, "the next four decided again")
        assert asked == [4, 5, 0, 1]
        assert not tasks[5].done()
        for n in (4, 0):  # the decision, with the time it waited
            assert tasks[n].result().decision is ADMITTED.decision and tasks[n].result().held_s > 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert room.held == 0 and not room._waiters

    asyncio.run(run())


class HeldThenFailedOver(RefusedWhileStreaming):
    """Two mixed workers: the first request to mixed-0; any other refused for the TBT while a stream
    decodes, then sent to mixed-1 while it is offered, else to mixed-0 (its failover)."""

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.asked.append(request.slo.ttft_s)
        workers = {w.id: w for w in cluster.by_role(Role.MIXED)}
        if any(w.decodes for w in workers.values()):
            rejection = Rejection(reason=TBT_SLO, message="the streams cannot absorb it", retry_after_s=1.0)
            return Decision(request.request_id, self.name, rejection=rejection)
        target = "mixed-1" if len(self.asked) > 1 and "mixed-1" in workers else "mixed-0"
        return Decision(request.request_id, self.name, prefill=target)


def test_a_held_request_that_fails_over_keeps_the_slo_it_was_admitted_with() -> None:
    """Held, admitted to a worker that fails, decided again elsewhere: the failover's decision sees
    the TTFT SLO the wait left (not the whole SLO again), and the request is served."""
    gate = threading.Semaphore(0)
    policy = HeldThenFailedOver()
    standin = {"mixed": {"token_gate": gate}}
    with cluster(n_prefill=0, n_decode=0, n_mixed=2, policy=policy, standin=standin, slo={"ttft_s": 120.0}) as c:
        c.mixed[1].fail_status = 503  # mixed-1 answers every completion with a 503

        async def run() -> tuple[int, httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                first = await _streaming(c, client)
                second = asyncio.create_task(client.post(c.url + "/v1/completions", json=SECOND))
                await _polled(lambda: c.gateway.waiting_room.held == 1, "the second request was not held")
                gate.release(10)
                return await first, await second

        first_status, second = asyncio.run(run())
    assert first_status == 200
    assert second.status_code == 200, second.text
    assert c.mixed[1].requests and c.mixed[0].requests  # tried on mixed-1, served by mixed-0
    woken, failover = policy.asked[-2:]
    assert woken is not None and woken < 120.0  # decided again with the wait taken off
    assert failover == woken  # the failover keeps it
    assert _metric(c, "conductor_hold_seconds_count", {"outcome": "admitted"}) == 1
