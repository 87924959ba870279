"""When a refit clears the ratio windows behind the calibrated bounds: only those of the model that
moved, and only when its predictions moved where it is used (over its window's own samples)."""

from __future__ import annotations

import random

import pytest

from predictors import Predictors
from predictors.online import TBT_RATIOS, TTFT_RATIOS


def _calibrated() -> Predictors:
    """Bundled predictors whose every ratio window holds enough ratios to bound with."""
    pred = Predictors.from_bundled_profile()
    for key in (*TTFT_RATIOS, *TBT_RATIOS):
        for k in range(30):
            pred.ratios.add(key, 1.0, 1.0 + 0.01 * k)
    return pred


def _held(pred: Predictors) -> dict[str, int]:
    return {key: pred.ratios.samples(key) for key in (*TTFT_RATIOS, *TBT_RATIOS)}


def test_a_tbt_refit_that_moves_the_model_clears_only_the_tbt_side() -> None:
    pred = _calibrated()
    rng = random.Random(1)
    for _ in range(8):  # the first refit comes at 8 samples; streams 3x slower than the profile says
        batch, kv = rng.randint(1, 8), rng.randint(1_000, 20_000)
        pred.observe_tbt(batch, kv, 3.0 * pred.tbt_s(batch, kv))
    held = _held(pred)
    assert all(held[key] == 0 for key in TBT_RATIOS if key != "tbt") and held["tbt"] < 30, held
    assert all(held[key] == 30 for key in TTFT_RATIOS), held  # the TTFT bound keeps its calibration
    assert pred.generation == (0, 1)


def test_a_prefill_refit_that_moves_the_model_clears_only_the_ttft_side() -> None:
    pred = _calibrated()
    rng = random.Random(2)
    for _ in range(8):
        new = rng.randint(100, 4_000)
        pred.observe_prefill(new, 0, pred.prefill_s(new) / 3.0)
    held = _held(pred)
    assert all(held[key] == 0 for key in TTFT_RATIOS), held
    assert all(held[key] == 30 for key in TBT_RATIOS), held
    assert pred.generation == (1, 0)
    # a TBT bound falls back on the TBT model's own p90 ratio, not the prefill model's
    assert pred.bound("tbt_at_decision", 1.0, 0.9) == pytest.approx(1.261)  # its window was kept: 1.00 .. 1.29
    pred.ratios.clear(TBT_RATIOS)
    assert pred.bound("tbt_at_decision", 1.0, 0.9) == pred.params.tbt.p90_ratio
    assert pred.bound("ttft", 1.0, 0.9) == pred.params.prefill.p90_ratio


def test_refits_that_leave_the_predictions_where_they_were_clear_nothing() -> None:
    pred = _calibrated()
    rng = random.Random(3)
    for _ in range(64):  # observations the models already predict: each refitted at 8, 16 and 48
        batch, kv, new = rng.randint(1, 8), rng.randint(1_000, 20_000), rng.randint(100, 4_000)
        pred.observe_tbt(batch, kv, pred.tbt_s(batch, kv))
        pred.observe_prefill(new, 0, pred.prefill_s(new))
    assert pred.refits == 6
    assert pred.generation == (0, 0)
    assert all(held >= 30 for held in _held(pred).values())
