"""Calibrated bounds from ratio windows, plain and shifted."""

from __future__ import annotations

import random

import pytest

from predictors.quantile import RatioWindow, RatioWindows


def test_plain_window_is_a_ratio_quantile() -> None:
    w = RatioWindow(window=100, min_samples=10)
    for i in range(100):
        w.add(1.0, 1.0 + i / 100)  # ratios 1.00 .. 1.99
    assert w.quantile(0.5, 9.0) == pytest.approx(1.495)
    assert w.bound(2.0, 0.5, 9.0) == pytest.approx(2.99)


def test_too_few_ratios_give_the_default() -> None:
    w = RatioWindow(window=100, min_samples=10, shift=0.5)
    for _ in range(9):
        w.add(1.0, 3.0)
    assert w.bound(2.0, 0.9, 1.25) == pytest.approx(2.5)
    assert RatioWindows(shifts={"ttft": 0.5}).bound("ttft", 2.0, 0.9, 1.25) == pytest.approx(2.5)


def test_a_fixed_delay_stays_additive_under_a_shift() -> None:
    """Errors of +0.3 s on short predictions (one unseen prefill ahead): the plain ratio makes a
    long prediction's bound a multiple of it, a shift of the order of the delay keeps it near
    prediction + delay."""
    plain, shifted = RatioWindow(256, 20), RatioWindow(256, 20, shift=0.3)
    rng = random.Random(3)
    for _ in range(256):
        p = rng.uniform(0.05, 0.15)
        actual = p + (0.3 if rng.random() < 0.2 else 0.0)
        plain.add(p, actual)
        shifted.add(p, actual)
    assert plain.bound(2.0, 0.95, 1.0) > 6.0  # ratios of ~3-7 carried onto 2 s
    assert 2.3 <= shifted.bound(2.0, 0.95, 1.0) < 4.0  # (2.0 + 0.3) * ~1.7 - 0.3
    # on the predictions it learned from, both bounds cover the delayed ones
    assert plain.bound(0.1, 0.95, 1.0) >= 0.38 and shifted.bound(0.1, 0.95, 1.0) >= 0.38


def test_coverage_holds_on_the_window_it_learned_from() -> None:
    """Whatever the shift, the q bound covers a q share of draws from the same distribution."""
    rng = random.Random(11)
    draws = [(p, p * rng.lognormvariate(0, 0.3) + rng.expovariate(10)) for p in (rng.uniform(0.05, 2.0) for _ in range(4000))]
    for shift in (0.0, 0.2, 1.0):
        w = RatioWindow(window=2000, min_samples=20, shift=shift)
        for p, a in draws[:2000]:
            w.add(p, a)
        covered = sum(a <= w.bound(p, 0.9, 1.0) for p, a in draws[2000:]) / 2000
        assert 0.87 <= covered <= 0.93, (shift, covered)


def test_a_shift_must_be_finite_and_not_negative() -> None:
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            RatioWindow(shift=bad)
