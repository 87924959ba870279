"""The gateway's waiting room in the simulator (traces/sim/hold.py): a job refused for its TBT only
waits for streams to end, decided again with its TTFT SLO less its wait, as
conductor/routing/waiting_room.py holds a live request."""

from __future__ import annotations

from dataclasses import replace

from conductor.config.groups import HoldSettings
from conductor.core.types import ClusterSnapshot, Decision, Observation, Rejection, RequestView, Slo
from policies.admission import TBT_SLO, WAKE_PER_END
from traces.formats import TraceRequest
from traces.sim.config import SimConfig
from traces.sim.engine import Simulator
from traces.sim.truth import fit_truth

TTFT_SLO = 30.0


class RefusedWhileStreaming:
    """The one mixed worker, refused for the TBT while a stream decodes there; keeps what it was asked."""

    name = "refused_while_streaming"

    def __init__(self, retryable: bool = True) -> None:
        self.retryable = retryable
        self.asked: list[tuple[str, float | None]] = []  # (request, TTFT SLO it was judged by) per decision
        self.decided: list[str] = []  # the decisions acted upon (on_decided)
        self.observed: list[Observation] = []

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.asked.append((request.request_id, request.slo.ttft_s))
        worker = cluster.instances[0]
        if worker.decodes:
            refusal = Rejection(TBT_SLO, "the streams cannot absorb it", retry_after_s=1.0, retryable=self.retryable)
            return Decision(request.request_id, self.name, rejection=refusal)
        return Decision(request.request_id, self.name, prefill=worker.id)

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        self.decided.append(request.request_id)

    def observe(self, observation: Observation) -> None:
        self.observed.append(observation)


def _run(policy: RefusedWhileStreaming, n: int = 2, **config: object) -> Simulator:
    base = SimConfig(0, 1, truth=fit_truth(), noise=0.0, slo=Slo(ttft_s=TTFT_SLO, tbt_s=1.0), mixed=True, pull="none")
    sim = Simulator(policy, replace(base, **config))  # type: ignore[arg-type]
    trace = [TraceRequest(arrival_s=0.01 * i, input_length=2000, output_length=40, hash_ids=(i,), line=i) for i in range(n)]
    sim.run(trace)
    return sim


def test_a_job_refused_for_its_tbt_waits_for_the_stream_and_is_served() -> None:
    policy = RefusedWhileStreaming()
    sim = _run(policy)
    first, second = sim.jobs
    assert not sim.rejections and second.refused == ""
    assert second.first_token > first.finish  # admitted once the first stream ended
    # decided on arrival, held, then again at the stream's end with the SLO less its wait
    asked = [slo for rid, slo in policy.asked if rid == "r1"]
    assert asked[0] == TTFT_SLO and len(asked) == 2
    assert asked[1] is not None and asked[1] == TTFT_SLO - (second.dispatch - second.arrival)
    assert policy.decided == ["r0", "r1"]  # a held decision is not acted upon
    # what the policy learns counts from its admission, the results from its arrival
    learned = {o.request_id: o.ttft_s for o in policy.observed}
    assert learned["r1"] == second.first_token - second.dispatch < second.first_token - second.arrival


def test_without_room_or_when_waiting_cannot_cure_it_the_refusal_stands() -> None:
    for policy, config in (
        (RefusedWhileStreaming(), {"hold_max": 0}),
        (RefusedWhileStreaming(retryable=False), {}),
    ):
        sim = _run(policy, **config)
        assert sim.rejections == {TBT_SLO: 1} and sim.jobs[1].refused == TBT_SLO
        assert [rid for rid, _ in policy.asked] == ["r0", "r1"]


def test_a_held_job_is_refused_at_its_deadline() -> None:
    policy = RefusedWhileStreaming()
    sim = _run(policy, hold_max_wait_s=0.05)  # the first stream lasts longer than that
    first, second = sim.jobs
    assert sim.rejections == {TBT_SLO: 1} and second.refused == TBT_SLO
    assert first.finish > 0.05
    assert policy.decided == ["r0", "r1"]  # the refusal at its deadline is the decision acted upon


def test_a_stream_end_decides_again_the_longest_waiting_few() -> None:
    policy = RefusedWhileStreaming()
    sim = _run(policy, n=WAKE_PER_END + 3)
    assert not sim.rejections
    # at the first stream's end, WAKE_PER_END held jobs are decided again, the earliest held first
    second_round = [rid for rid, slo in policy.asked[WAKE_PER_END + 3 :]][:WAKE_PER_END]
    assert second_round == [f"r{i}" for i in range(1, WAKE_PER_END + 1)]


def test_the_simulators_room_is_the_gateways_by_default() -> None:
    gateway = HoldSettings()
    sim = SimConfig(1, 1)
    assert (sim.hold_max, sim.hold_max_wait_s) == (gateway.max_held, gateway.max_wait_s)
