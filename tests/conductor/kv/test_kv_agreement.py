"""Hash agreement both ways, per instance, and the diagnosis of its likely cause (no I/O)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from conductor.kv.agreement import FeedEvidence, HashAgreement, HashSetup, Sample, diagnose

LOGGER = "conductor.kv"
HEALTHY = FeedEvidence(configured=True, endpoint="tcp://w:5557", batches=10)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_under_prediction_raises_its_own_alarm_with_the_cause(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    evidence = {"p0": FeedEvidence(configured=True, endpoint="tcp://w:5557", batches=40, orphans=96)}
    agreement = HashAgreement(registry, window=50, min_samples=10, evidence=lambda name: evidence.get(name, HEALTHY))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(10):  # the index predicted nothing; the worker had 512 tokens cached each time
            agreement.observe(0, 512, instance="p0")
        for _ in range(10):
            agreement.observe(256, 256, instance="p1")
    value = registry.get_sample_value
    assert value("conductor_kv_hash_agreement") == 1.0  # nothing over-predicted: the old gauge stays blind
    assert value("conductor_kv_hash_coverage") == pytest.approx(2560 / (5120 + 2560))
    assert value("conductor_kv_instance_hash_coverage", {"instance": "p0"}) == 0.0
    assert value("conductor_kv_instance_hash_coverage", {"instance": "p1"}) == 1.0
    assert agreement.alarm("p0", "under") == "late_start" and agreement.alarm("p1", "under") is None
    assert value("conductor_kv_hash_alarm", {"instance": "p0", "direction": "under", "cause": "late_start"}) == 1
    (message,) = _warnings(caplog)
    assert message.startswith("KV CACHE HITS UNPREDICTED on p0") and "[late_start]" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(50):
            agreement.observe(512, 512, instance="p0")
    assert agreement.alarm("p0", "under") is None and not agreement.alarmed
    assert value("conductor_kv_hash_alarm", {"instance": "p0", "direction": "under", "cause": "late_start"}) == 0
    assert any("coverage on p0 recovered" in m for m in _warnings(caplog))


def test_over_prediction_blames_the_tokenizer_when_prompt_lengths_differ(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    agreement = HashAgreement(registry, window=20, min_samples=5, evidence=lambda _: HEALTHY)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(5):  # byte tokens at the gateway, a real vocabulary at the worker
            agreement.observe(2048, 16, instance="m0", prompt_tokens=2100, reported_prompt_tokens=530)
    assert agreement.alarm("m0", "over") == "tokenizer"
    assert registry.get_sample_value("conductor_kv_prompt_length_mismatches_total", {"instance": "m0"}) == 5
    (message,) = _warnings(caplog)
    assert message.startswith("KV HASH AGREEMENT COLLAPSED on m0") and "[tokenizer]" in message
    assert "gateway 2100 vs worker 530 tokens" in message and "built-in byte tokenizer" in message


def test_missing_events_are_reported_before_any_ratio_moves(caplog: pytest.LogCaptureFixture) -> None:
    silent = FeedEvidence(configured=True, endpoint="tcp://w:5557", batches=0)
    agreement = HashAgreement(CollectorRegistry(), min_samples=3, evidence=lambda _: silent)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(5):
            agreement.observe(0, None, instance="p0")  # even without usage details
    (message,) = _warnings(caplog)
    assert message.startswith("KV EVENTS MISSING from p0: 3 requests") and "tcp://w:5557" in message


SETUP = HashSetup(key_mode="vllm", algo="sha256_cbor", seed=None, tokenizer="/models/tok", block_size=16)


@pytest.mark.parametrize(
    ("evidence", "lengths", "tokenizer", "expected"),
    [
        (FeedEvidence(configured=True, batches=5, block_size_mismatched=32), None, "/t", "block_size"),
        (
            FeedEvidence(configured=True, batches=5, hash_checked=4, hash_mismatched=4, last_mismatch=(1, 2)),
            None,
            "/t",
            "hash_seed",
        ),
        (FeedEvidence(configured=True, batches=5), (100, 40), "/t", "tokenizer"),
        (FeedEvidence(configured=False), None, "/t", "no_events"),
        (FeedEvidence(configured=True, batches=0), None, "/t", "no_events"),
        (FeedEvidence(configured=True, batches=5, orphans=3), None, "/t", "late_start"),
        (FeedEvidence(configured=True, batches=5), None, "builtin", "tokenizer"),  # suspected: no lengths reported
        (FeedEvidence(configured=True, batches=5), (100, 100), "/t", "unknown"),
    ],
)
def test_diagnosis_names_the_cause_the_evidence_shows(
    evidence: FeedEvidence, lengths: tuple[int, int] | None, tokenizer: str, expected: str
) -> None:
    setup = HashSetup(SETUP.key_mode, SETUP.algo, SETUP.seed, tokenizer, SETUP.block_size)
    causes = diagnose(setup, "p0", [Sample(512, 0, lengths)] * 4, evidence, served=4)
    assert causes[0][0] == expected, causes
    if expected == "hash_seed":
        assert "kv.vllm_hash_seed unset (workers without PYTHONHASHSEED)" in causes[0][1]


def test_diagnosis_lists_every_cause_with_evidence_most_likely_first() -> None:
    ev = FeedEvidence(configured=True, batches=3, hash_checked=2, hash_mismatched=1, orphans=5)
    causes = [tag for tag, _ in diagnose(SETUP, "p0", [Sample(0, 64, (90, 30))], ev, served=1)]
    assert causes == ["hash_seed", "tokenizer", "late_start"]


def test_the_cause_is_revised_when_later_evidence_points_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    """Events arrive after the requests that caused them: the first diagnosis may be early."""
    feed = {"now": FeedEvidence(configured=True, endpoint="tcp://w:5557", batches=0)}
    agreement = HashAgreement(CollectorRegistry(), min_samples=3, evidence=lambda _: feed["now"])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            agreement.observe(0, 256, instance="p0")
        assert agreement.alarm("p0", "under") == "no_events"
        feed["now"] = FeedEvidence(configured=True, endpoint="tcp://w:5557", batches=4, orphans=8)
        agreement.observe(0, 256, instance="p0")
        agreement.observe(0, 256, instance="p0")  # same evidence: no second warning
    assert agreement.alarm("p0", "under") == "late_start"
    revised = [m for m in _warnings(caplog) if "KV CACHE HITS UNPREDICTED" in m]
    assert len(revised) == 2 and "(cause revised, was [no_events])" in revised[1] and "[late_start]" in revised[1]


def test_the_sliding_window_keeps_the_figures_a_full_recount_gives() -> None:
    """The window's running sums (O(1) per request) equal the figures recomputed from its samples,
    as samples come and the oldest leave."""
    import random

    from conductor.kv.diagnosis import SampleWindow, agreement, coverage

    rng = random.Random(7)
    window = SampleWindow(25)
    kept: list[Sample] = []
    for _ in range(400):
        sample = Sample(rng.choice([0, 0, 16, 512]) * rng.randint(0, 3), rng.choice([0, 16, 256]) * rng.randint(0, 2))
        window.append(sample)
        kept = [*kept, sample][-25:]
        assert list(window) == kept
        assert window.agreement == agreement(kept) and window.coverage == coverage(kept)
        assert window.predicting == sum(s.predicted > 0 for s in kept)
        assert window.reporting == sum(s.reported > 0 for s in kept)
        assert window.confirmed == sum(min(s.predicted, s.reported) for s in kept)
