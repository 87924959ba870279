"""Running prefills that overran their whole queue's prediction make a decision predict prefills as
slow as they have shown themselves to be (predictors/overrun.py), and nothing else does."""

from __future__ import annotations

import pytest

from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Role, Slo
from policies.registry import load_policy
from predictors.online import Predictors
from predictors.overrun import overrun_scale
from tests.policies.cluster_builders import decode, request, snapshot

PRED = Predictors.from_bundled_profile()


def _prefill(iid: str, *queue: tuple[int, float]) -> InstanceView:
    """A prefill instance whose queue holds prefills of these (uncached tokens, elapsed) each."""
    return InstanceView(iid, Role.PREFILL, prefill_queue=tuple(QueuedPrefill(n, 0, e) for n, e in queue))


def test_no_queue_or_a_head_within_its_prediction_shows_nothing() -> None:
    head_s = PRED.prefill_s(4000)
    assert overrun_scale(PRED, [_prefill("p0")], mixed=False) == 1.0
    assert overrun_scale(PRED, [_prefill("p0", (4000, 1.4 * head_s))], mixed=False) == 1.0  # noise, batching


def test_a_head_past_its_whole_queues_prediction_gives_the_lower_bound_of_the_error() -> None:
    queue_s = PRED.prefill_s(4000) + PRED.prefill_s(2000)
    inst = _prefill("p0", (4000, 3.0 * queue_s), (2000, 0.0))
    other = _prefill("p1", (4000, 2.0 * PRED.prefill_s(4000)))  # also over, by less: the larger counts
    assert overrun_scale(PRED, [inst, other], mixed=False) == pytest.approx(3.0)
    scaled = PRED.prefill_scaled(3.0)
    assert scaled.prefill_s(1000, 500) == pytest.approx(3.0 * PRED.prefill_s(1000, 500))
    # the head is past its scaled end too: what is left ahead is the next prefill, scaled
    assert scaled.queue_s(inst.prefill_queue) == pytest.approx(3.0 * PRED.prefill_s(2000))
    assert PRED.prefill_s(1000) == pytest.approx(PRED.params.prefill.predict((1.0, 1000.0, 1000.0 * 1000)))  # the original kept


def test_a_mixed_workers_head_is_held_to_its_stretched_time() -> None:
    pred = Predictors.from_bundled_profile()
    plain_s = pred.prefill_s(4000)
    pred.mixed_coef = (0.0, 0.0, 0.0, 2.0 * plain_s / 4000 / 8)  # 8 streams there double a prefill
    streams = tuple(ActiveDecode(1000, 100) for _ in range(8))
    worker = InstanceView("m0", Role.MIXED, prefill_queue=(QueuedPrefill(4000, 0, 2.5 * plain_s),), decodes=streams)
    assert overrun_scale(pred, [worker], mixed=False) == pytest.approx(2.5)  # as if nothing stretched it
    assert overrun_scale(pred, [worker], mixed=True) == 1.0  # 2.5x of plain is within 1.5x of 3x


def test_a_decision_behind_overrunning_prefills_predicts_and_admits_by_them() -> None:
    # the bundled profile predicts a 30K-token prefill well inside a 3 s TTFT SLO; both instances'
    # heads have run 8x their whole queue's prediction: the workers are far slower than the profile
    slo = Slo(ttft_s=3.0, tbt_s=1.0)
    head_s = PRED.prefill_s(6000)
    fresh = load_policy("kvcache_aware", {})
    calm = snapshot(_prefill("p0", (6000, 0.5 * head_s)), _prefill("p1", (6000, 0.5 * head_s)), decode("d0"))
    over = snapshot(_prefill("p0", (6000, 8 * head_s)), _prefill("p1", (6000, 8 * head_s)), decode("d0"))
    admitted = fresh.decide(request(30_000, slo=slo, rid="a"), calm)
    refused = fresh.decide(request(30_000, slo=slo, rid="b"), over)
    assert admitted.rejection is None and admitted.predicted_ttft_s is not None
    assert admitted.predicted_ttft_s < 3.0
    assert refused.rejection is not None and refused.rejection.reason == "ttft_slo"
    # its own prefill alone is predicted 8x: the running ones showed the model 8x too fast
    assert refused.rejection.predicted_s is not None
    assert refused.rejection.predicted_s >= 8 * PRED.prefill_s(30_000)


def test_a_head_whose_end_is_not_seen_is_no_evidence() -> None:
    # a non-streamed request on a mixed worker leaves the queue only with its whole answer: its
    # elapsed time may be mostly decoding (so also another replica's entry, whose kind is not shared)
    queue = (QueuedPrefill(4000, 0, 10 * PRED.prefill_s(4000), end_seen=False),)
    assert overrun_scale(PRED, [InstanceView("m0", Role.MIXED, prefill_queue=queue)], mixed=True) == 1.0
