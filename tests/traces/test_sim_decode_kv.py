"""Decode KV space in the simulator: vLLM's recompute preemption ("preempt", the default) against
reserving prompt + all output at join ("reserve").

Two streams of 1,000 prompt and 1,500 output tokens share a decode instance with room for 3,000
KV tokens: both fit when they join, their growth does not. With preemption the later one is
dropped when the cache fills, rejoins when the other finishes and first recomputes its whole
context on the decode instance; with reservation it waits for the other to finish before it joins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from conductor.core.types import ClusterSnapshot, Decision, Observation, RequestView, Slo
from traces.formats import TraceRequest
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.truth import DecodeTruth, fit_truth


class Pinned:
    """Request k prefills on prefill-k and decodes on decode-0; keeps the observations."""

    name = "pinned"

    def __init__(self) -> None:
        self.observed: dict[str, Observation] = {}

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        return Decision(request.request_id, self.name, prefill=f"prefill-{request.seq}", decode="decode-0")

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        return None

    def observe(self, observation: Observation) -> None:
        self.observed[observation.request_id] = observation


TRACE = [
    TraceRequest(arrival_s=0.0, input_length=1000, output_length=1500, hash_ids=(1, 2), line=1),
    TraceRequest(arrival_s=0.5, input_length=1000, output_length=1500, hash_ids=(3, 4), line=2),
]


def run(mode: str) -> tuple[dict[str, Observation], Mapping[str, float], SimConfig]:
    truth = replace(fit_truth(), decode=DecodeTruth(kv_capacity_tokens=3000))
    config = SimConfig(2, 1, truth=truth, noise=0.0, slo=Slo(ttft_s=600.0, tbt_s=10.0), decode_kv=mode)
    policy = Pinned()
    res = simulate(policy, TRACE, config)
    assert res.completed == 2
    return policy.observed, res.extra, config


def finish(o: Observation) -> float:
    assert o.ttft_s is not None
    return o.ttft_s + o.token_intervals_s[0] * (o.output_tokens - 1)


def test_the_stream_that_joined_last_is_preempted_and_recomputes_when_it_rejoins() -> None:
    obs, extra, config = run("preempt")
    a, b = obs["r0"], obs["r1"]
    assert extra["preemptions"] == 1
    assert a.decode_batch == 0 and b.decode_batch == 1  # both joined: each fit when it arrived
    # a was never held up: its steps ran at the two-stream or one-stream step time throughout
    steps = config.truth.decode
    assert a.token_intervals_s[0] <= steps.tbt_s(2, 3000) + 1e-9
    # b rejoined only after a finished, then recomputed its context (its prompt and ~half its
    # output: the cache filled when the two had generated ~1,000 tokens between them)
    b_end = 0.5 + finish(b)
    recompute = config.truth.prefill_s(1000 + 450, 0)
    assert b_end > finish(a) + recompute + 1000 * steps.tbt_s(1, 1000)
    assert b.token_intervals_s[0] > 1.5 * steps.tbt_s(2, 3000)  # the pause shows in its TBT


def test_reserving_the_whole_output_makes_the_second_stream_wait_instead() -> None:
    obs, extra, _ = run("reserve")
    a, b = obs["r0"], obs["r1"]
    assert extra["preemptions"] == 0
    assert b.decode_batch == 0  # it joined only when a had left
    assert b.ttft_s is not None and 0.5 + b.ttft_s >= finish(a)
    assert b.token_intervals_s[0] == pytest.approx(a.token_intervals_s[0], rel=0.01)  # no pause, alone


def test_an_unknown_decode_kv_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_kv must be one of"):
        SimConfig(1, 1, decode_kv="swap")
