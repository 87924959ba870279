"""Why the gateway's KV index and the workers disagree: the evidence (`FeedEvidence`: what one
instance's KV event feed has shown; the finished requests' `Sample`s) and `diagnose`, which names the
likely causes, most likely first. The agreement figures and their alarms: conductor/kv/agreement.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FeedEvidence:
    """What the KV event feed of one instance has shown (see adapters/index/feed.py)."""

    configured: bool = False  # a KV events endpoint is configured for the instance
    endpoint: str | None = None
    batches: int = 0  # event batches received, live and replayed
    hash_checked: int = 0  # prompt-start blocks whose vLLM hash the gateway recomputed
    hash_mismatched: int = 0  # ... and found different
    last_mismatch: tuple[int, int] | None = None  # (worker's hash, gateway's hash)
    orphans: int = 0  # blocks stored under parents the gateway never saw stored
    block_size_mismatched: int = 0  # blocks in events of another block size


@dataclass(frozen=True, slots=True)
class HashSetup:
    """What the gateway assumes about the workers: quoted in the warnings."""

    key_mode: str = "xxhash"
    algo: str = "sha256"
    seed: str | None = None
    tokenizer: str = "builtin"
    block_size: int = 16


EvidenceSource = Callable[[str], FeedEvidence]


@dataclass(frozen=True, slots=True)
class Sample:
    predicted: int
    reported: int
    lengths: tuple[int, int] | None = None  # (gateway, worker) prompt tokens, when both are known


class SampleWindow:
    """The last `size` samples with their sums kept as they come and go, so a finished request costs
    O(1) however long the window: recomputing the figures from the samples on every request (six
    passes over 200) was 40% of a gateway's CPU per request with KV awareness on (profiled,
    benchmarks/profile_gateway.py). Iterates as its samples, oldest first; the sums are exact (ints)."""

    __slots__ = ("_samples", "confirmed", "predicted", "predicting", "reported", "reporting", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._samples: deque[Sample] = deque()
        self.predicted = self.reported = self.confirmed = 0  # token sums; confirmed: of min(predicted, reported)
        self.predicting = self.reporting = 0  # samples that predicted / reported any cached token

    def append(self, sample: Sample) -> None:
        if self.size <= 0:
            return
        if len(self._samples) == self.size:
            self._count(self._samples.popleft(), -1)
        self._samples.append(sample)
        self._count(sample, 1)

    def _count(self, s: Sample, sign: int) -> None:
        self.predicted += sign * s.predicted
        self.reported += sign * s.reported
        self.confirmed += sign * min(s.predicted, s.reported)
        self.predicting += sign * (s.predicted > 0)
        self.reporting += sign * (s.reported > 0)

    @property
    def agreement(self) -> float:
        return 1.0 if self.predicted == 0 else self.confirmed / self.predicted

    @property
    def coverage(self) -> float:
        return 1.0 if self.reported == 0 else self.confirmed / self.reported

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self._samples)


def agreement(samples: Iterable[Sample]) -> float:
    predicted = confirmed = 0
    for s in samples:
        predicted += s.predicted
        confirmed += min(s.predicted, s.reported)
    return 1.0 if predicted == 0 else confirmed / predicted


def coverage(samples: Iterable[Sample]) -> float:
    reported = confirmed = 0
    for s in samples:
        reported += s.reported
        confirmed += min(s.predicted, s.reported)
    return 1.0 if reported == 0 else confirmed / reported


def _tokenizer_name(setup: HashSetup) -> str:
    return "the built-in byte tokenizer" if setup.tokenizer == "builtin" else f"kv.tokenizer {setup.tokenizer!r}"


Cause = tuple[str, str]  # (stable tag, explanation)


def _feed_causes(setup: HashSetup, instance: str, ev: FeedEvidence) -> list[Cause]:
    """What the events themselves show: blocks of another size, hashes the gateway computes otherwise."""
    causes: list[Cause] = []
    if ev.block_size_mismatched:
        causes.append(
            (
                "block_size",
                f"{ev.block_size_mismatched} blocks from {instance} came in KV events of "
                f"another block size than block_size {setup.block_size}: set it to the workers' --block-size",
            )
        )
    if ev.hash_checked and 2 * ev.hash_mismatched >= ev.hash_checked:
        seed = "unset (workers without PYTHONHASHSEED)" if setup.seed is None else repr(setup.seed)
        last = (
            ""
            if ev.last_mismatch is None
            else f" (last: worker {ev.last_mismatch[0]:#018x}, gateway {ev.last_mismatch[1]:#018x})"
        )
        causes.append(
            (
                "hash_seed",
                f"{ev.hash_mismatched} of {ev.hash_checked} KV events from {instance} that start "
                f"a prompt carry a block hash other than the gateway's vLLM hash of their own token ids{last}: "
                f"kv.vllm_hash_algo {setup.algo!r} / kv.vllm_hash_seed {seed} do not match the workers' "
                "--prefix-caching-hash-algo / PYTHONHASHSEED (the gateway's own PYTHONHASHSEED is never used)",
            )
        )
    return causes


def _length_cause(setup: HashSetup, lengths: list[tuple[int, int]]) -> Cause | None:
    """The workers counting most prompts otherwise than the gateway: another tokenizer."""
    differing = [pair for pair in lengths if pair[0] != pair[1]]
    if not lengths or 2 * len(differing) < len(lengths):
        return None
    gw, worker = differing[-1]
    return (
        "tokenizer",
        f"the workers counted another prompt length than the gateway in {len(differing)} "
        f"of {len(lengths)} recent requests (e.g. gateway {gw} vs worker {worker} tokens): "
        f"{_tokenizer_name(setup)} is not the model's; set kv.tokenizer to the model's tokenizer "
        "directory or 'worker'",
    )


def _arrival_causes(instance: str, ev: FeedEvidence, served: int) -> list[Cause]:
    """Events that never came, or came for prefixes the gateway never saw stored."""
    causes: list[Cause] = []
    if not ev.configured:
        causes.append(
            (
                "no_events",
                f"no KV events endpoint is configured for {instance}: the index knows only this "
                "gateway's dispatches, forgotten after kv.unconfirmed_ttl_s; give it a kv_events_endpoint",
            )
        )
    elif ev.batches == 0:
        causes.append(
            (
                "no_events",
                f"no KV event has arrived from {instance} ({ev.endpoint}) while {served} "
                "requests were served there: check the worker's --kv-events-config and that the gateway "
                "reaches that endpoint",
            )
        )
    if ev.orphans:
        causes.append(
            (
                "late_start",
                f"{ev.orphans} blocks from {instance} were stored under blocks the gateway never "
                "saw stored: the worker cached those prefixes before the gateway listened (or events were "
                "lost) and no replay reached back; give the instance a replay endpoint or reset its prefix cache",
            )
        )
    return causes


_BUILTIN_TOKENIZER: Cause = (
    "tokenizer",
    "the gateway tokenizes with the built-in byte tokenizer, which only emulated "
    "workers share; against a real model set kv.tokenizer (not confirmed: the workers' prompt "
    "lengths were not reported)",
)
_UNKNOWN: Cause = (
    "unknown",
    "no evidence points at one cause: check block_size against --block-size, "
    "kv.key_mode / kv.vllm_hash_algo / kv.vllm_hash_seed against --prefix-caching-hash-algo / "
    "PYTHONHASHSEED, kv.tokenizer against the model, and that KV events arrive",
)


def diagnose(setup: HashSetup, instance: str, samples: Iterable[Sample], ev: FeedEvidence, served: int) -> list[Cause]:
    """Likely causes of a disagreement, most likely first: (tag, explanation) pairs. The tags are
    stable (block_size, hash_seed, tokenizer, no_events, late_start, unknown)."""
    lengths = [s.lengths for s in samples if s.lengths is not None]
    causes = _feed_causes(setup, instance, ev)
    length_cause = _length_cause(setup, lengths)
    if length_cause is not None:
        causes.append(length_cause)
    causes.extend(_arrival_causes(instance, ev, served))
    if not causes and setup.tokenizer == "builtin" and not lengths:
        causes.append(_BUILTIN_TOKENIZER)
    return causes or [_UNKNOWN]


def explain(causes: list[tuple[str, str]]) -> str:
    (tag, text), rest = causes[0], causes[1:]
    return f"Likely cause [{tag}]: {text}." + "".join(f" Also [{t}]: {x}." for t, x in rest)
