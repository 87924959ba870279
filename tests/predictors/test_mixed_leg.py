"""The mixed leg model (issue 39): a mixed worker's TTFT grows with the streams that share its engine
(their decode tokens ride in every prefill chunk's step; their KV slows every step), which the plain
prefill formula cannot see. Learned online from mixed legs, its stretch enters the worker's queue
and prefill predictions."""

from __future__ import annotations

import itertools
import random

import pytest

from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Role
from predictors import OnlineConfig, Predictors, bundled_profile, fit_profiles
from predictors.params import NO_STRETCH, mixed_leg_features, prefill_features

# the truth: a prefill of n tokens beside streams holding R context tokens takes
# (c0 + c1 n + c2 n^2) * (1 + R / 40,000): a KV-pressure stretch the plain formula lacks
BASE = (0.015, 9.0e-5, 2.0e-9)


def _truth(n: int, resident: int) -> float:
    c0, c1, c2 = BASE
    return (c0 + c1 * n + c2 * n * n) * (1.0 + resident / 40_000)


def _worker(streams: int, context: int = 4000, queued: tuple[int, ...] = ()) -> InstanceView:
    return InstanceView(
        "m0",
        Role.MIXED,
        prefill_queue=tuple(QueuedPrefill(q, 0, 0.0) for q in queued),
        decodes=tuple(ActiveDecode(context, 32) for _ in range(streams)),
    )


def _samples(count: int, seed: int = 1) -> list[tuple[int, int, int, float]]:
    """(prompt tokens, streams, resident tokens, leg seconds) of legs on an idle queue, 3% noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n, streams = rng.randint(1024, 6144), rng.randint(0, 8)
        resident = streams * 4000
        out.append((n, streams, resident, _truth(n, resident) * rng.lognormvariate(0.0, 0.03)))
    return out


def _mape(pred: Predictors, cases: list[tuple[int, int, int, float]]) -> float:
    errs = []
    for n, streams, _, seconds in cases:
        est = pred.prefill_s(n, 0)
        s0, s1 = pred.mixed_stretch(_worker(streams))
        errs.append(abs(est + s0 + s1 * n - seconds) / seconds)
    return sum(errs) / len(errs)


def test_mixed_legs_teach_the_stretch_of_the_streams_sharing_the_engine() -> None:
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig())
    plain = Predictors(fit_profiles([bundled_profile()]), OnlineConfig())
    for n, streams, resident, seconds in _samples(256):
        pred.observe_mixed_leg(mixed_leg_features(prefill_features(n, 0), resident, streams), seconds)
        plain.observe_leg(prefill_features(n, 0), seconds)  # the old rule: one formula for every worker
    held_out = _samples(100, seed=2)
    assert _mape(pred, held_out) < 0.05
    # without the streams' term the best one formula misses by far more
    assert _mape(plain, held_out) > 0.15
    # the prefill model is the fit's stream-free part: a worker alone prefills at the base cost
    assert pred.prefill_s(4096, 0) == pytest.approx(_truth(4096, 0), rel=0.05)
    assert pred.mixed_stretch(_worker(0)) is NO_STRETCH


def test_the_stretch_enters_every_queued_prefill_and_the_request() -> None:
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(enabled=False))
    pred.mixed_coef = (1.0e-6, 2.0e-9, 0.0, 0.0)  # per prefill and per token, per resident token
    worker = _worker(4, queued=(2000, 3000))
    s0, s1 = pred.mixed_stretch(worker)
    assert (s0, s1) == pytest.approx((1.0e-6 * 16_000, 2.0e-9 * 16_000))
    plain = pred.queue_s(worker.prefill_queue)
    assert pred.queue_s(worker.prefill_queue, (s0, s1)) == pytest.approx(plain + 2 * s0 + s1 * 5000)
    assert pred.queue_s(worker.prefill_queue, NO_STRETCH) == plain


def test_a_mixed_leg_is_a_lesson_a_sibling_learns_alike() -> None:
    a = Predictors(fit_profiles([bundled_profile()]), OnlineConfig())
    b = Predictors(fit_profiles([bundled_profile()]), OnlineConfig())
    lessons = a.record_lessons()
    for n, streams, resident, seconds in _samples(64):
        a.observe_mixed_leg(mixed_leg_features(prefill_features(n, 0), resident, streams), seconds)
    assert lessons and all(lesson[0] == "mixed_leg" for lesson in lessons)
    for lesson in lessons:
        b.learn(list(lesson))
    assert b.mixed_coef == a.mixed_coef and b.params.prefill.coef == a.params.prefill.coef
    assert any(a.mixed_coef)


def _refits_at(pred: Predictors, legs: list[tuple[int, int, int, float]], scale: float = 1.0, mixed: bool = True) -> list[int]:
    """The 1-based indices of the legs after which `pred` refitted: fed as mixed legs, or (`mixed`
    False) as plain prefill legs; each leg's seconds times `scale`."""
    at = []
    for i, (n, streams, resident, seconds) in enumerate(legs, 1):
        before = pred.refits
        if mixed:
            pred.observe_mixed_leg(mixed_leg_features(prefill_features(n, 0), resident, streams), scale * seconds)
        else:
            pred.observe_leg(prefill_features(n, 0), scale * seconds)
        if pred.refits > before:
            at.append(i)
    return at


def test_the_mixed_leg_model_refits_on_its_own_shorter_interval() -> None:
    """The mixed leg model refits every `mixed_refit_every` legs while the others keep `refit_every`;
    backed off on a steady feed, a shifted truth brings it back to its own interval, not to 32."""
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(refit_every=32, mixed_refit_every=8))
    assert _refits_at(pred, _samples(64)) == [8, 16, 24, 32, 40, 48, 56, 64]
    plain = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(refit_every=32, mixed_refit_every=8))
    assert _refits_at(plain, _samples(64), mixed=False) == [8, 16, 48]

    steady = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(window=64, refit_max_every=64, mixed_refit_every=8))
    calm = _refits_at(steady, _samples(512, seed=3))
    assert max(b - a for a, b in itertools.pairwise(calm)) > 8  # backed off while nothing moved
    shifted = _refits_at(steady, _samples(96, seed=4), scale=2.0)
    first = shifted[0]  # due on the backed-off interval; it moves the model, so every 8 again
    assert first > 8 and shifted[1] == first + 8  # (refit_every's 32 would come at first + 32)


def _leg_mape(pred: Predictors, legs: list[tuple[int, int, int, float]], scale: float) -> float:
    """Each leg predicted as a decision on mixed workers predicts it (`prefill_scaled(mixed_scale)`)
    before it is learned; its seconds times `scale`."""
    errs = []
    for n, streams, resident, seconds in legs:
        view = pred.prefill_scaled(pred.mixed_scale)
        s0, s1 = view.mixed_stretch(_worker(streams))
        actual = scale * seconds
        errs.append(abs(view.prefill_s(n, 0) + s0 + s1 * n - actual) / actual)
        pred.observe_mixed_leg(mixed_leg_features(prefill_features(n, 0), resident, streams), actual)
    return sum(errs) / len(errs)


def test_the_newest_mixed_legs_scale_predictions_before_the_refit_follows_a_surge() -> None:
    """A surge makes every leg 1.4x slower. The refit weighs its 512-leg window alike and follows
    over hundreds of legs; `mixed_scale`, the median actual / predicted of the newest legs (8 by
    default), takes the prediction there within them, and back when the surge ends."""
    tracked = Predictors(fit_profiles([bundled_profile()]), OnlineConfig())
    fit_only = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(mixed_recent=0))
    for pred in (tracked, fit_only):
        _leg_mape(pred, _samples(512, seed=5), 1.0)
    assert tracked.mixed_scale == pytest.approx(1.0, abs=0.05)
    surge = _samples(64, seed=6)
    assert _leg_mape(tracked, surge, 1.4) < 0.5 * _leg_mape(fit_only, surge, 1.4)
    assert tracked.mixed_scale == pytest.approx(1.4, rel=0.1) and fit_only.mixed_scale == 1.0
    _leg_mape(tracked, _samples(32, seed=7), 1.0)
    assert tracked.mixed_scale == pytest.approx(1.0, abs=0.05)  # the surge over, so is its scale


def test_the_recent_scale_is_bounded() -> None:
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig())
    _leg_mape(pred, _samples(256, seed=8), 1.0)
    _leg_mape(pred, _samples(16, seed=9), 10.0)  # ten times slower: beyond what the scale may say
    assert pred.mixed_scale == Predictors.MIXED_SCALE_MAX
