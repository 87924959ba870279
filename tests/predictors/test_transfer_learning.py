"""The transfer model learns online from every disaggregated request's decode leg (TTFT minus the
prefill leg: the P -> D handoff of the prompt's KV, then the first decode steps and HTTP)."""

from __future__ import annotations

import math
import random

import pytest

from conductor.core.types import Slo
from predictors import INSTANCE_LINK, STORE_LINK, OnlineConfig, Predictors, bundled_profile, fit_profiles
from traces.formats import load_trace, resolve_trace
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.runner import PolicySpec, build_policy
from traces.sim.truth import PAPER_KV_BYTES_PER_TOKEN, fit_truth


def us_per_token(pred: Predictors, link: str = INSTANCE_LINK) -> float:
    return pred.params.transfer_model(link).coef[1] * pred.kv_bytes_per_token * 1e6


def test_decode_legs_teach_the_transfer_model() -> None:
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(window=400, refit_every=32))
    true_us, rng = 11.8, random.Random(5)  # the link is ~10x slower per token than the profile's
    before = us_per_token(pred)
    assert abs(before / true_us - 1) > 0.5
    for _ in range(400):
        tokens = rng.randint(200, 30_000)
        tbt = rng.uniform(0.015, 0.06)
        leg = 0.003 + tokens * true_us * 1e-6 + 1.5 * tbt
        if rng.random() < 0.05:
            leg *= 4.0  # a stalled transfer now and then
        pred.observe_decode_leg(tokens, tbt, leg * math.exp(rng.gauss(0, 0.03)))
    assert us_per_token(pred) == pytest.approx(true_us, rel=0.05)
    assert us_per_token(pred, STORE_LINK) == pytest.approx(true_us, rel=0.05)  # the store link was a copy
    # and the TTFT's decode leg predicted from it: handoff + first-token model
    tokens, tbt = 8000, 0.03
    predicted = pred.first_token_s(pred.transfer_s(tokens), tbt)
    assert predicted == pytest.approx(0.003 + tokens * true_us * 1e-6 + 1.5 * tbt, rel=0.05)


def test_no_learning_when_online_refits_are_off() -> None:
    pred = Predictors(fit_profiles([bundled_profile()]), OnlineConfig(enabled=False))
    before = us_per_token(pred)
    for _ in range(200):
        pred.observe_decode_leg(10_000, 0.03, 0.2)
    assert us_per_token(pred) == before


def test_kvcache_aware_learns_the_simulated_link() -> None:
    # the paper setting: 320 KB of KV a token over the profile's link, while the bundled profile's
    # model has about 2.3x fewer bytes a token: the predictor starts ~2x low and must catch up
    truth = fit_truth(prefill_scale=7.0).with_options(kv_bytes_per_token=PAPER_KV_BYTES_PER_TOKEN, link_bandwidth_bps=27e9)
    config = SimConfig(8, 8, truth=truth, slo=Slo(ttft_s=30.0, tbt_s=0.1))
    policy = build_policy(PolicySpec("kvcache_aware", {"admission": "none"}), config)
    pred = policy.predictors  # type: ignore[attr-defined]
    true_us = truth.kv_bytes_per_token / truth.link_bandwidth_bps * 1e6
    assert us_per_token(pred) < 0.2 * true_us
    simulate(policy, load_trace(resolve_trace("conversation-head400")).requests, config)
    assert us_per_token(pred) == pytest.approx(true_us, rel=0.1)
