"""Lessons (predictors/lessons.py): a process that learns every lesson of another ends up with the
same models; its calibrated bounds stay its own; a malformed lesson is refused whole; nothing echoes back."""

from __future__ import annotations

import math
import random

import pytest

from predictors.lessons import checked
from predictors.online import OnlineConfig, Predictors
from predictors.params import INSTANCE_LINK

RATIO_KEYS = ("ttft", "queue_and_prefill", "tbt_at_decision")


def _observe_a_day(pred: Predictors, rng: random.Random, n: int) -> None:
    """A mixed stream of every kind of observation, with noise, as a gateway's policy makes them."""
    for _ in range(n):
        new, cached = rng.randint(64, 8192), rng.choice((0, 0, 512, 2048))
        true_prefill = 2e-5 * new + 1e-9 * new * (new + cached) + 0.004
        pred.observe_prefill(new, cached, true_prefill * rng.uniform(0.9, 1.2), instance="p0")
        pred.observe_leg((float(new), float(new * (new + cached)), 1.0), true_prefill * rng.uniform(1.0, 2.0))
        pred.observe_decode_leg(new + cached, rng.uniform(0.01, 0.05), rng.uniform(0.01, 0.2))
        batch, kv = rng.randint(1, 64), rng.randint(1000, 200_000)
        pred.observe_tbt(batch, kv, (0.008 + 1e-4 * batch + 5e-8 * kv) * rng.uniform(0.9, 1.1), instance="d0")
        pred.observe_transfer(INSTANCE_LINK, float(new * 131072), new * 131072 / 20e9 + rng.uniform(0, 0.002))
        key = rng.choice(RATIO_KEYS)
        predicted = rng.uniform(0.05, 2.0)
        pred.ratios.add(key, predicted, predicted * rng.uniform(0.7, 1.6))


def _quantiles(pred: Predictors, keys: tuple[str, ...]) -> tuple[float, ...]:
    return tuple(pred.ratios.quantile(k, q, -1.0) for k in keys for q in (0.5, 0.9, 0.99))


def _state(pred: Predictors) -> tuple[object, ...]:
    # the "tbt" ratios are the models' own: observe_tbt adds each against the model's prediction
    return pred.params, pred.first_token_model, pred.decode_leg_model, pred.generation, pred.refits, _quantiles(pred, ("tbt",))


def test_a_sibling_that_learns_every_lesson_has_the_same_models() -> None:
    teacher, pupil = Predictors.from_bundled_profile(), Predictors.from_bundled_profile()
    lessons = teacher.record_lessons()
    own = pupil.record_lessons()  # a pupil that shares too must not send a learned lesson back
    rng = random.Random(7)
    for _ in range(10):  # in batches, as datagrams would bring them
        _observe_a_day(teacher, rng, 40)
        while lessons:
            pupil.learn(list(lessons.popleft()))  # as decoded from msgpack: lists, not tuples
    assert teacher.refits > 10  # the stream refitted every model several times
    assert _state(pupil) == _state(teacher)  # bit for bit: the same samples in the same order
    assert not own
    # the bounds' ratios measure the teacher's predictions: the pupil calibrates on its own requests
    assert _quantiles(pupil, RATIO_KEYS) == (-1.0,) * 9 != _quantiles(teacher, RATIO_KEYS)
    # and the diagnostics stay each process's own: the pupil recorded no errors of the teacher's
    assert not [s for s in pupil.error_stats() if s.samples]
    assert [s for s in teacher.error_stats() if s.samples]


def test_without_the_lessons_the_sibling_learns_nothing() -> None:
    teacher, loner = Predictors.from_bundled_profile(), Predictors.from_bundled_profile()
    _observe_a_day(teacher, random.Random(7), 100)
    assert _state(loner) != _state(teacher)  # so the equality above is the lessons' doing


def test_lessons_are_bounded_and_off_until_asked_for() -> None:
    pred = Predictors.from_bundled_profile(OnlineConfig(track_errors=False))
    _observe_a_day(pred, random.Random(1), 5)  # nothing kept before record_lessons
    lessons = pred.record_lessons(maxlen=10)
    _observe_a_day(pred, random.Random(2), 20)
    assert len(lessons) == 10
    assert lessons[-1][0] == "transfer"  # the most recent kept: each round ends with a transfer


@pytest.mark.parametrize(
    "raw",
    [
        "prefill",
        [],
        ["nope", 1, 2, 3.0],
        ["prefill", 1, 2],
        ["prefill", 1, 2, 3.0, 4],
        ["prefill", 1.5, 2, 3.0],
        ["prefill", True, 2, 3.0],
        ["tbt", 4, 100, math.nan],
        ["tbt", 4, 100, math.inf],
        ["leg", 1.0, 2.0, 3.0, 1e300],
        ["transfer", "", 10.0, 1.0],
        ["transfer", "x" * 65, 10.0, 1.0],
        ["transfer", "a\nb", 10.0, 1.0],
        ["transfer", 7, 1.0, 1.0],
        ["transfer", "x", "1", 1.0],
        [3, 1, 2, 3.0],
        ["ratio", "ttft", 1.0, 1.5],  # ratios are no lessons (predictors/lessons.py)
    ],
)
def test_a_malformed_lesson_is_refused_and_teaches_nothing(raw: object) -> None:
    pred = Predictors.from_bundled_profile()
    before = _state(pred)
    with pytest.raises(ValueError):
        checked(raw)
    with pytest.raises(ValueError):
        pred.learn(raw)
    assert _state(pred) == before


def test_checked_normalizes_numbers() -> None:
    assert checked(["tbt", 4, 100, 2]) == ("tbt", 4, 100, 2.0)
    assert isinstance(checked(["leg", 1, 2, 3, 4])[1], float)
