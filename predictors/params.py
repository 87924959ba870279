"""The fitted parameters of every latency model, and the feature maps that give them meaning.

Model forms (all linear in their coefficients, fitted by `predictors.linear.fit_linear`):

* T_prefill(new, cached) = c0 + c1 * new + c2 * new * (new + 2 * cached)
  The linear term is the per-token work (projections, MLP: ~2 * params FLOPs a token); the
  quadratic term is attention: new token i attends to cached + i keys, so the score and value work
  sums to new * cached + new^2 / 2 = new * (new + 2 * cached) / 2. c0 is the fixed cost of a step
  (scheduling, kernel launches, sampling, HTTP). With cached = 0 this is the usual quadratic in
  prompt length; with a cached prefix it charges attention over the cached context but nothing for
  the MLP of cached tokens, which is exactly what prefix caching saves.
* T_transfer(bytes) = latency + bytes / bandwidth, one model per link class ("instance" for
  instance -> instance over RDMA/TCP, "store" for Mooncake Store -> instance).
* Mixed leg (a mixed worker: prefills and decodes share one engine) = the prefill leg above plus,
  for every prefill of the queue and the request, s0 + s1 * new tokens, where s0 = m0 * R + m2 * S
  and s1 = m1 * R + m3 * S over the S streams listed on the worker holding R context tokens. A
  chunked-prefill engine runs the streams' decode tokens in every chunk's step (a prefill pays
  their cost once per chunk: per prefill and per token) and slows every step as the resident KV
  nears the cache's size (a stretch rising with R); the coefficients are learned online from the
  mixed workers' observed first tokens, starting at 0 (predictors.online.observe_mixed_leg).
* TBT(batch, resident_kv) = d0 + d1 * batch + d2 * resident_kv. A decode step is memory bound: it
  reads the weights once (d0), the KV of every resident token (d2) and does per-sequence work such
  as sampling (d1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from conductor.core.types import QueuedPrefill
from predictors.linear import LinearModel

INSTANCE_LINK = "instance"  # prefix pulled from another instance's memory
STORE_LINK = "store"  # prefix pulled from the pooled Mooncake Store
PARAMS_VERSION = 1


def prefill_features(new_tokens: float, cached_tokens: float) -> tuple[float, float, float]:
    return (1.0, new_tokens, new_tokens * (new_tokens + 2.0 * cached_tokens))


NO_STRETCH = (0.0, 0.0)  # (s0, s1) of a worker no stream shares: the plain prefill formula


def mixed_leg_features(leg: tuple[float, float, float], resident_tokens: float, streams: float) -> tuple[float, ...]:
    """The mixed leg model's features: a prefill leg's summed prefill features (`leg`: the queue's
    and the request's) and their products with the worker's resident context tokens and streams
    at decision time (the model's form is in the module docstring)."""
    f0, f1, f2 = leg
    return (f0, f1, f2, f0 * resident_tokens, f1 * resident_tokens, f0 * streams, f1 * streams)


def transfer_features(nbytes: float) -> tuple[float, float]:
    return (1.0, nbytes)


def tbt_features(batch: float, resident_kv_tokens: float) -> tuple[float, float, float]:
    return (1.0, batch, resident_kv_tokens)


@dataclass(frozen=True, slots=True)
class DecodePrior:
    """Where the TBT model starts when no decode measurements exist (a roofline, not a fit).

    d0 = weight_bytes / hbm_bytes_per_s, d2 = kv_bytes_per_token / hbm_bytes_per_s, d1 =
    per_sequence_s. Defaults: Qwen3-8B in bf16 (8.2e9 parameters, 16.4 GB) on one H800 (HBM3,
    3.35 TB/s), 100 us of per-sequence work a step. Online refits from observed token intervals
    replace it: the prior only anchors directions the observed window does not vary.
    """

    weight_bytes: float = 16.4e9
    hbm_bytes_per_s: float = 3.35e12
    per_sequence_s: float = 1.0e-4
    p90_ratio: float = 1.25  # assumed spread until residuals are measured

    def model(self, kv_bytes_per_token: float) -> LinearModel:
        return LinearModel(
            coef=(
                self.weight_bytes / self.hbm_bytes_per_s,
                self.per_sequence_s,
                kv_bytes_per_token / self.hbm_bytes_per_s,
            ),
            p90_ratio=self.p90_ratio,
        )


@dataclass(frozen=True, slots=True)
class PredictorParams:
    """Everything `conductor fit` writes and a policy loads: plain data, JSON round-trippable."""

    prefill: LinearModel  # coefficients of prefill_features, seconds
    transfer: Mapping[str, LinearModel]  # link class -> coefficients of transfer_features, seconds
    tbt: LinearModel  # coefficients of tbt_features, seconds
    kv_bytes_per_token: float  # KV cache bytes one token occupies (all layers, K and V)
    source: str = ""  # where the fit came from (profile path, "online", ...)
    notes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def transfer_model(self, link: str) -> LinearModel:
        model = self.transfer.get(link)
        if model is None:
            model = self.transfer[INSTANCE_LINK]
        return model

    def scaled(self, prefill: float = 1.0, tbt: float = 1.0, transfer: float = 1.0) -> PredictorParams:
        """These params with every time multiplied: e.g. an 8B profile stood in for a 70B-class
        model (DESIGN: "scale the profile's prefill cost"), or a slower network."""

        def mul(m: LinearModel, k: float) -> LinearModel:
            return LinearModel(tuple(c * k for c in m.coef), m.p90_ratio, m.samples, m.mape)

        notes = dict(self.notes)
        notes["scaled"] = f"prefill x{prefill:g}, tbt x{tbt:g}, transfer x{transfer:g}"
        return PredictorParams(
            prefill=mul(self.prefill, prefill),
            transfer=MappingProxyType({k: mul(v, transfer) for k, v in self.transfer.items()}),
            tbt=mul(self.tbt, tbt),
            kv_bytes_per_token=self.kv_bytes_per_token,
            source=self.source,
            notes=MappingProxyType(notes),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PARAMS_VERSION,
            "source": self.source,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefill": self.prefill.to_dict(),
            "transfer": {k: v.to_dict() for k, v in self.transfer.items()},
            "tbt": self.tbt.to_dict(),
            "notes": dict(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PredictorParams:
        if data.get("version") != PARAMS_VERSION:
            raise ValueError(f"unsupported predictor params version {data.get('version')!r}")
        transfer = {str(k): LinearModel.from_dict(v) for k, v in dict(data["transfer"]).items()}
        if INSTANCE_LINK not in transfer:
            raise ValueError(f"predictor params need a {INSTANCE_LINK!r} transfer link")
        prefill = LinearModel.from_dict(data["prefill"])
        tbt = LinearModel.from_dict(data["tbt"])
        if len(prefill.coef) != 3 or len(tbt.coef) != 3 or any(len(m.coef) != 2 for m in transfer.values()):
            raise ValueError("predictor params have the wrong number of coefficients")
        return cls(
            prefill=prefill,
            transfer=MappingProxyType(transfer),
            tbt=tbt,
            kv_bytes_per_token=float(data["kv_bytes_per_token"]),
            source=str(data.get("source", "")),
            notes=MappingProxyType({str(k): str(v) for k, v in dict(data.get("notes", {})).items()}),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PredictorParams:
        return cls.from_dict(json.loads(Path(path).read_text()))


def queue_features(queue: Sequence[QueuedPrefill]) -> tuple[tuple[float, float, float], float]:
    """(sum of prefill_features over every queued entry, the head's elapsed time).

    Behind an FCFS queue whose head started running `elapsed` ago, a new prefill's leg is (head's
    run time - elapsed) + the others' + its own: linear in the prefill coefficients with these
    summed features, which is what `Predictors.observe_leg` fits to.
    """
    f0 = f1 = f2 = 0.0
    for q in queue:
        n = q.new_tokens
        f0 += 1.0
        f1 += n
        f2 += n * (n + 2.0 * q.cached_tokens)
    return (f0, f1, f2), (queue[0].elapsed_s if queue else 0.0)
