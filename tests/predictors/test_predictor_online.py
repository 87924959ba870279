"""Online refit: convergence on noisy synthetic data with outliers, bounded windows, p90 coverage,
error tracking and the queue model."""

from __future__ import annotations

import math
import random

import pytest

from conductor.core.types import QueuedPrefill
from predictors import ErrorTracker, OnlineConfig, Predictors, bundled_profile, fit_profiles

TRUE_PREFILL = (0.06, 5.0e-5, 3.0e-10)  # a slower, 70B-class machine than the bundled profile
TRUE_TBT = (0.012, 2.0e-4, 6.0e-8)


def true_prefill(new: int, cached: int) -> float:
    c0, c1, c2 = TRUE_PREFILL
    return c0 + c1 * new + c2 * new * (new + 2 * cached)


def noisy(rng: random.Random, value: float, sigma: float = 0.05, outlier_p: float = 0.1) -> float:
    if rng.random() < outlier_p:
        return value * rng.choice((0.2, 5.0, 10.0))  # stalls, preemptions, clock glitches
    return value * math.exp(rng.gauss(0.0, sigma))


@pytest.fixture()
def predictors() -> Predictors:
    return Predictors(fit_profiles([bundled_profile()]), OnlineConfig(window=400, refit_every=50))


def test_prefill_refit_converges_despite_outliers(predictors: Predictors) -> None:
    rng = random.Random(7)
    before = predictors.prefill_s(8000, 0)
    for _ in range(600):
        new = rng.randint(64, 16000)
        cached = rng.choice((0, 0, rng.randint(0, 16000)))
        predictors.observe_prefill(new, cached, noisy(rng, true_prefill(new, cached)), "p0")
    assert predictors.refits >= 6  # 12 every 50 samples; steady refits back off once the window is full
    assert predictors.params.prefill.samples <= 400  # fitted on the bounded window only
    for new, cached in ((128, 0), (2000, 0), (8000, 0), (16000, 0), (1000, 15000)):
        assert predictors.prefill_s(new, cached) == pytest.approx(true_prefill(new, cached), rel=0.06)
    assert abs(before - true_prefill(8000, 0)) / true_prefill(8000, 0) > 0.3  # it really moved


def test_tbt_refit_replaces_prior(predictors: Predictors) -> None:
    rng = random.Random(3)

    def tbt(b: int, kv: int) -> float:
        return TRUE_TBT[0] + TRUE_TBT[1] * b + TRUE_TBT[2] * kv

    prior_error = abs(predictors.tbt_s(32, 100_000) - tbt(32, 100_000)) / tbt(32, 100_000)
    for _ in range(400):
        b = rng.randint(1, 128)
        kv = b * rng.randint(200, 4000)
        predictors.observe_tbt(b, kv, noisy(rng, tbt(b, kv), sigma=0.03, outlier_p=0.05), "d0")
    for b, kv in ((1, 1000), (32, 100_000), (128, 400_000)):
        assert predictors.tbt_s(b, kv) == pytest.approx(tbt(b, kv), rel=0.05)
    assert prior_error > 0.3


def test_p90_bound_covers_about_90_percent(predictors: Predictors) -> None:
    rng = random.Random(11)
    for _ in range(400):
        new = rng.randint(64, 16000)
        predictors.observe_prefill(new, 0, true_prefill(new, 0) * math.exp(rng.gauss(0, 0.1)), "p0")
    tracker = ErrorTracker(window=2000)
    for _ in range(2000):
        new = rng.randint(64, 16000)
        actual = true_prefill(new, 0) * math.exp(rng.gauss(0, 0.1))
        tracker.record("prefill", "p0", predictors.prefill_s(new, 0), predictors.prefill_p90_s(new, 0), actual)
    (stats,) = tracker.stats()
    assert 0.85 <= stats.p90_coverage <= 0.95
    assert stats.mape == pytest.approx(0.08, abs=0.02)  # E|lognormal(0, 0.1) - 1| ~ 0.08
    assert stats.bias == pytest.approx(1.0, abs=0.03)


def test_offline_fit_p90_comes_from_residuals() -> None:
    params = fit_profiles([bundled_profile()])
    assert 1.0 < params.prefill.p90_ratio < 1.1


def test_disabled_online_never_refits() -> None:
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(enabled=False))
    coef = pred.params.prefill.coef
    for n in range(100, 10000, 50):
        pred.observe_prefill(n, 0, 10 * true_prefill(n, 0))
    assert pred.params.prefill.coef == coef and pred.refits == 0
    assert pred.error_stats()[0].samples > 0  # errors are still tracked


def test_error_tracker_is_bounded() -> None:
    tracker = ErrorTracker(window=5, max_keys=3)
    for i in range(10):
        for k in range(7):
            tracker.record("ttft", f"p{i}", 1.0, 1.2, 1.0 + k / 10)
    stats = tracker.stats()
    assert len(tracker) == 3 and {s.instance for s in stats} == {"p7", "p8", "p9"}
    assert all(s.samples == 5 for s in stats)
    tracker.record("ttft", "p9", 0.0, 0.0, 1.0)  # nonsense predictions are ignored
    assert len(tracker) == 3


def test_queue_counts_only_what_is_left_of_the_head(predictors: Predictors) -> None:
    t = predictors.prefill_s
    q = (QueuedPrefill(4000, 0, 0.05), QueuedPrefill(2000, 1000, 0.01), QueuedPrefill(8000, 0, 0.0))
    expected = (t(4000, 0) - 0.05) + t(2000, 1000) + t(8000, 0)
    assert predictors.queue_s(q) == pytest.approx(expected)
    # a head that has run longer than predicted counts as done, never negative
    late = (QueuedPrefill(100, 0, 30.0), QueuedPrefill(100, 0, 1.0))
    assert predictors.queue_s(late) == pytest.approx(t(100, 0))
    assert predictors.queue_s(()) == 0.0


def test_steady_refits_back_off_and_a_change_brings_them_back() -> None:
    cfg = OnlineConfig(window=128, refit_every=16, refit_max_every=128)
    pred = Predictors(fit_profiles([bundled_profile()]), cfg)
    rng = random.Random(11)

    def feed(n: int, slowdown: float) -> int:
        before = pred.refits
        for _ in range(n):
            new = rng.randint(64, 16000)
            pred.observe_prefill(new, 0, true_prefill(new, 0) * slowdown * math.exp(rng.gauss(0.0, 0.02)), "p0")
        return pred.refits - before

    feed(512, 1.0)
    steady = feed(2048, 1.0)  # every 16 would be 128 refits; a steady model backs off to every 128
    assert steady <= 2048 // 64  # 16 here
    for new in (500, 4000, 16000):
        assert pred.prefill_s(new, 0) == pytest.approx(true_prefill(new, 0), rel=0.03)
    # the cluster turns 40% slower: the first refit that sees it moves the model, the interval
    # drops back to 16, and the model follows within a few windows
    changed = feed(1024, 1.4)
    assert changed > steady // 2  # more often than while steady (11 here)
    for new in (500, 4000, 16000):
        assert pred.prefill_s(new, 0) == pytest.approx(1.4 * true_prefill(new, 0), rel=0.03)
    # with the back-off off (max = base), the same steady feed refits at every 16th sample
    flat = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(window=128, refit_every=16, refit_max_every=16))
    pred = flat
    feed(512, 1.0)
    assert feed(2048, 1.0) == 2048 // 16


def test_a_young_window_refits_as_it_doubles_then_every_refit_every() -> None:
    """Refits at 8 and 16 samples (min_samples, doubled while below refit_every), then every 32:
    a model that starts 3x off is close after the first 8 samples, not after 32."""
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(min_samples=8, refit_every=32))
    rng = random.Random(5)
    at = []
    for i in range(1, 81):
        new = rng.randint(500, 12000)
        before = pred.refits
        pred.observe_prefill(new, 0, 3 * true_prefill(new, 0), "p0")
        if pred.refits > before:
            at.append(i)
        if i == 8:  # from 1/3 of the truth to within a quarter of it
            assert pred.prefill_s(4000, 0) == pytest.approx(3 * true_prefill(4000, 0), rel=0.25)
        if i == 16:
            assert pred.prefill_s(4000, 0) == pytest.approx(3 * true_prefill(4000, 0), rel=0.1)
    assert at == [8, 16, 48, 80]
    # min_samples is the first refit however it is set: 10, 20, then every 32 (from 20: 52)
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(min_samples=10, refit_every=32))
    at = []
    for i in range(1, 60):
        before = pred.refits
        pred.observe_prefill(4000 + i, 0, true_prefill(4000 + i, 0), "p0")
        if pred.refits > before:
            at.append(i)
    assert at == [10, 20, 52]
