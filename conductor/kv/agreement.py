"""Does the gateway's KV index agree with the workers? Both ways, per instance, with a likely cause.

When a request finishes, the worker says how many prompt tokens it found cached
(usage.prompt_tokens_details.cached_tokens) and the index had predicted some number for it. Over a
sliding window of finished requests, per chosen prefill instance and over all of them:

- agreement = sum(min(predicted, reported)) / sum(predicted): the share of predicted hits the
  workers confirmed. Low means OVER-prediction: the index routes to caches that are not there
  (gateway keys unlike the workers': tokenizer, block size, hash algorithm or seed).
  `conductor_kv_hash_agreement` (1.0 while nothing was predicted).
- coverage = sum(min(predicted, reported)) / sum(reported): the share of the workers' real hits the
  index knew about. Low means UNDER-prediction: hits are lost to routing (KV events missing or
  unusable, a wrong seed hiding them, a gateway started after the workers filled their caches).
  `conductor_kv_hash_coverage` (1.0 while nothing was reported cached).

Either falling below its threshold logs one loud warning per instance and direction, naming the
likely cause from evidence (`diagnose`): blocks of another block size in the events; KV events whose
block hashes are not the gateway's vLLM hashes of their own token ids (seed / algorithm); workers
counting other prompt lengths than the gateway (tokenizer); no events from the instance at all; or
events that chain onto blocks the gateway never saw stored (late start).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge

from conductor.config.kv import KVAwarenessSettings
from conductor.kv.diagnosis import (
    EvidenceSource,
    FeedEvidence,
    HashSetup,
    Sample,
    SampleWindow,
    agreement,
    coverage,
    diagnose,
    explain,
)

__all__ = ["EvidenceSource", "FeedEvidence", "HashAgreement", "HashSetup", "Sample", "agreement", "coverage", "diagnose"]

# the analyzer's logger: operators filter and alert on it (this module was split out of kv_awareness)
log = logging.getLogger(__name__)

Direction = Literal["over", "under"]
MAX_INSTANCES = 1024  # windows kept; instance names come from the configuration, this is a backstop


class _Instance:
    __slots__ = ("alarms", "served", "silent_warned", "window")

    def __init__(self, window: int) -> None:
        self.window = SampleWindow(window)
        self.alarms: dict[Direction, str | None] = {"over": None, "under": None}  # cause tag while alarmed
        self.served = 0
        self.silent_warned = False


class HashAgreement:
    """Predicted vs worker-reported cached tokens over sliding windows, both ways, per instance."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        window: int = 200,
        min_samples: int = 20,
        alarm_below: float = 0.2,
        coverage_alarm_below: float = 0.8,
        setup: HashSetup | None = None,
        evidence: EvidenceSource | None = None,
    ) -> None:
        self._window_size = window
        self._window = SampleWindow(window)
        self._instances: dict[str, _Instance] = {}
        self._min_samples = min_samples
        self._thresholds: dict[Direction, float] = {"over": alarm_below, "under": coverage_alarm_below}
        self._setup = setup or HashSetup()
        self._evidence = evidence or (lambda _: FeedEvidence(configured=True, batches=1))
        self._ratio = Gauge(
            "conductor_kv_hash_agreement",
            "Share of the cached prompt tokens the index predicted that the workers reported, over the "
            "recent window (1 = no over-prediction; low: the gateway's block keys do not match)",
            registry=registry,
        )
        self._coverage = Gauge(
            "conductor_kv_hash_coverage",
            "Share of the cached prompt tokens the workers reported that the index had predicted, "
            "over the recent window (1 = no hit missed; low: events missing, wrong seed, late start)",
            registry=registry,
        )
        self._inst_ratio = Gauge(
            "conductor_kv_instance_hash_agreement",
            "conductor_kv_hash_agreement per prefill instance",
            ["instance"],
            registry=registry,
        )
        self._inst_coverage = Gauge(
            "conductor_kv_instance_hash_coverage",
            "conductor_kv_hash_coverage per prefill instance",
            ["instance"],
            registry=registry,
        )
        self._alarm = Gauge(
            "conductor_kv_hash_alarm",
            "1 while the agreement (direction over) or coverage "
            "(direction under) alarm is raised on an instance, labelled with the likely cause",
            ["instance", "direction", "cause"],
            registry=registry,
        )
        self._predicted = Counter(
            "conductor_kv_predicted_cached_tokens",
            "Cached prompt tokens the index predicted on the chosen prefill instance",
            registry=registry,
        )
        self._reported = Counter(
            "conductor_kv_reported_cached_tokens", "Cached prompt tokens the workers reported", registry=registry
        )
        self._length_checks = Counter(
            "conductor_kv_prompt_length_checks",
            "Requests whose prompt length the worker reported, to compare with the gateway's tokenizer",
            ["instance"],
            registry=registry,
        )
        self._length_mismatches = Counter(
            "conductor_kv_prompt_length_mismatches",
            "Requests whose prompt length the worker counted unlike the gateway's tokenizer",
            ["instance"],
            registry=registry,
        )
        self._ratio.set(1.0)
        self._coverage.set(1.0)

    def set_evidence(self, evidence: EvidenceSource) -> None:
        """Where the diagnosis reads each instance's feed evidence (the analyzer, built after this)."""
        self._evidence = evidence

    @property
    def alarmed(self) -> bool:
        return any(cause is not None for inst in self._instances.values() for cause in inst.alarms.values())

    def alarm(self, instance: str, direction: Direction) -> str | None:
        """The cause tag of the alarm raised on `instance` in `direction`, None when not alarmed."""
        inst = self._instances.get(instance)
        return None if inst is None else inst.alarms[direction]

    def instance_figures(self, instance: str) -> dict[str, Any] | None:
        """`instance`'s window as the status page shows it (None before its first finished request)."""
        inst = self._instances.get(instance)
        if inst is None:
            return None
        return {
            "samples": len(inst.window),
            "agreement": round(inst.window.agreement, 4),
            "coverage": round(inst.window.coverage, 4),
            "alarms": {direction: cause for direction, cause in inst.alarms.items() if cause is not None},
        }

    @property
    def ratio(self) -> float:
        return self._window.agreement

    @property
    def coverage(self) -> float:
        return self._window.coverage

    def observe(
        self,
        predicted: int,
        reported: int | None,
        *,
        instance: str = "",
        prompt_tokens: int | None = None,
        reported_prompt_tokens: int | None = None,
    ) -> None:
        """One finished request: what the index predicted cached on `instance`, what its worker reported;
        `prompt_tokens` (the gateway's exact count) and `reported_prompt_tokens` (the worker's) when known."""
        inst = self._instance(instance)
        if inst is None:
            return
        inst.served += 1
        self._check_silence(instance, inst)
        if reported is None:  # the worker did not say (no usage details): nothing to compare
            return
        lengths = None
        if prompt_tokens is not None and reported_prompt_tokens is not None:
            lengths = (prompt_tokens, reported_prompt_tokens)
            self._length_checks.labels(instance).inc()
            if prompt_tokens != reported_prompt_tokens:
                self._length_mismatches.labels(instance).inc()
        sample = Sample(predicted, reported, lengths)
        self._predicted.inc(predicted)
        self._reported.inc(reported)
        self._window.append(sample)
        inst.window.append(sample)
        self._ratio.set(self.ratio)
        self._coverage.set(self.coverage)
        self._inst_ratio.labels(instance).set(inst.window.agreement)
        self._inst_coverage.labels(instance).set(inst.window.coverage)
        self._check(instance, inst, "over")
        self._check(instance, inst, "under")

    def _instance(self, name: str) -> _Instance | None:
        inst = self._instances.get(name)
        if inst is None and len(self._instances) < MAX_INSTANCES:
            inst = self._instances[name] = _Instance(self._window_size)
        return inst

    def _check_silence(self, name: str, inst: _Instance) -> None:
        """Say so early when an instance with an events endpoint has sent none at all."""
        if inst.silent_warned or inst.served < self._min_samples:
            return
        ev = self._evidence(name)
        if ev.configured and ev.batches == 0:
            inst.silent_warned = True
            log.warning(
                "KV EVENTS MISSING from %s: %d requests were served there but no KV event arrived from %s; "
                "the index knows only this gateway's own dispatches. Check the worker's --kv-events-config "
                "(enable_kv_cache_events, publisher zmq, endpoint) and that the gateway reaches it.",
                name,
                inst.served,
                ev.endpoint,
            )

    def _check(self, name: str, inst: _Instance, direction: Direction) -> None:
        over = direction == "over"
        window = inst.window
        figure = window.agreement if over else window.coverage
        threshold = self._thresholds[direction]
        raised = inst.alarms[direction]
        if raised is None:
            samples = window.predicting if over else window.reporting
            if samples >= self._min_samples and figure < threshold:
                self._raise(name, inst, direction, figure, None)
        elif figure >= (2 * threshold if over else (1 + threshold) / 2):
            inst.alarms[direction] = None
            self._alarm.labels(name, direction, raised).set(0)
            log.warning("KV hash %s on %s recovered: %.0f%%", "agreement" if over else "coverage", name, 100 * figure)
        else:  # still low: evidence keeps coming (events arrive after the requests), so look again
            self._raise(name, inst, direction, figure, raised)

    def _raise(self, name: str, inst: _Instance, direction: Direction, figure: float, raised: str | None) -> None:
        """Raise the alarm, or revise its cause when the evidence now points elsewhere; warn either way."""
        causes = diagnose(self._setup, name, inst.window, self._evidence(name), inst.served)
        cause = causes[0][0]
        if cause == raised:
            return
        if raised is not None:
            self._alarm.labels(name, direction, raised).set(0)
        inst.alarms[direction] = cause
        self._alarm.labels(name, direction, cause).set(1)
        confirmed = inst.window.confirmed
        revised = "" if raised is None else f" (cause revised, was [{raised}])"
        if direction == "over":
            log.warning(
                "KV HASH AGREEMENT COLLAPSED on %s%s: over the last %d requests the index predicted %d cached "
                "tokens there but the worker reported %d of them (%.0f%%). %s",
                name,
                revised,
                len(inst.window),
                inst.window.predicted,
                confirmed,
                100 * figure,
                explain(causes),
            )
        else:
            log.warning(
                "KV CACHE HITS UNPREDICTED on %s%s: over the last %d requests the worker reported %d cached "
                "tokens but the index had predicted %d of them (%.0f%% coverage): routing misses cache hits. %s",
                name,
                revised,
                len(inst.window),
                inst.window.reported,
                confirmed,
                100 * figure,
                explain(causes),
            )


def build_agreement(s: KVAwarenessSettings, registry: CollectorRegistry | None) -> HashAgreement:
    """The agreement windows and alarms the kv settings describe."""
    setup = HashSetup(s.key_mode, s.vllm_hash_algo, s.vllm_hash_seed, s.tokenizer, s.block_size)
    return HashAgreement(
        registry or CollectorRegistry(),
        window=s.agreement_window,
        min_samples=s.agreement_min_samples,
        alarm_below=s.agreement_alarm_below,
        coverage_alarm_below=s.agreement_coverage_alarm_below,
        setup=setup,
    )


@runtime_checkable
class KeepsAgreement(Protocol):
    """An analyzer with a KV index whose predictions it checks against the workers' (KVAwareAnalyzer)."""

    @property
    def agreement(self) -> HashAgreement: ...


def agreement_of(analyzer: object) -> HashAgreement | None:
    """The hash agreement the analyzer keeps; None without a KV index (nothing to agree on)."""
    return analyzer.agreement if isinstance(analyzer, KeepsAgreement) else None
