"""The simulator's ground truth: how long prefill, KV transfer and a decode step really take.

The policies' predictors never see these coefficients; they see only simulated outcomes, so a
predictor's error is part of what the simulation measures.

Prefill comes from a profile CSV (default: the bundled Qwen3-8B/H800 1P1D measurement, columns
`prompt_tokens, mean_ttft_ms, kv_bytes, transfer_ms`): TTFT minus the KV transfer is fitted as
`a + b*L + c*L^2` over prompt length L. A prefill of `new` tokens after `cached` reused ones costs
`a + b*new + c*((cached+new)^2 - cached^2)`: the linear part for the new tokens and the attention
of the new tokens over the whole context. `prefill_scale` multiplies the whole cost: to emulate the
paper's 70B-class model on 8xA800 we scale the *profile's prefill cost* (not the cluster), see
`PAPER_PREFILL_SCALE`.

The transfer link is fitted from the same rows as `latency + bytes / bandwidth`.

Decode has no published profile here, so the TBT truth is a documented model,
`tbt = base + per_seq * batch + per_kv_token * resident_kv_tokens`, with defaults for a 70B-class
model (see `DecodeTruth`); operators with a measured decode profile pass their own coefficients.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from conductor.core.profile import Profile as EmulatorProfile

DEFAULT_PROFILE = (
    Path(__file__).resolve().parents[2] / "conductor" / "data" / "profiles" / ("qwen3-8b-h800-1p1d-vllm-mooncake.csv")
)
# A 70B-class model costs about 9x the FLOPs of an 8B one per token; an 8xA800 node has less
# compute than the H800 node of the profile. 7x puts the conversation trace on 8 prefill nodes
# at the load the FAST'25 scheduling experiment shows (mean TTFT of seconds, not milliseconds).
PAPER_PREFILL_SCALE = 7.0
PAPER_KV_BYTES_PER_TOKEN = 320 * 1024  # LLaMA3-70B: 80 layers x 8 KV heads x 128 x 2 (K,V) x 2 bytes


@dataclass(frozen=True, slots=True)
class DecodeTruth:
    """TBT of one decode step on one instance, and the instance's limits."""

    base_s: float = 0.020  # weights read + launch overhead per step
    per_seq_s: float = 0.0006  # per running sequence (sampling, scheduling, MLP activations)
    per_kv_token_s: float = 2.0e-8  # reading resident KV: ~320 KB/token over ~16 TB/s of HBM
    kv_capacity_tokens: int = 400_000  # KV tokens a decode instance can hold; requests wait beyond
    max_batch: int = 128  # running sequences per instance (vLLM --max-num-seqs)

    def tbt_s(self, batch: int, resident_kv_tokens: int) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_kv_token_s * resident_kv_tokens


@dataclass(frozen=True, slots=True)
class TruthModel:
    """Fitted prefill and link coefficients plus the decode model. Times in seconds."""

    prefill_a: float  # fixed cost per prefill
    prefill_b: float  # per new token
    prefill_c: float  # attention: per (context^2 - cached^2)
    prefill_scale: float  # multiplies the fitted prefill cost (model-size emulation)
    link_latency_s: float  # per transfer
    link_bandwidth_bps: float  # bytes per second, per link
    kv_bytes_per_token: int  # KV size; sets transfer times
    decode: DecodeTruth = DecodeTruth()

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        ctx = cached_tokens + new_tokens
        raw = self.prefill_a + self.prefill_b * new_tokens + self.prefill_c * (ctx * ctx - cached_tokens * cached_tokens)
        return raw * self.prefill_scale

    def transfer_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.link_latency_s + tokens * self.kv_bytes_per_token / self.link_bandwidth_bps

    def with_options(
        self,
        *,
        prefill_scale: float | None = None,
        kv_bytes_per_token: int | None = None,
        link_bandwidth_bps: float | None = None,
        decode: DecodeTruth | None = None,
    ) -> TruthModel:
        return replace(
            self,
            prefill_scale=self.prefill_scale if prefill_scale is None else prefill_scale,
            kv_bytes_per_token=self.kv_bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token,
            link_bandwidth_bps=self.link_bandwidth_bps if link_bandwidth_bps is None else link_bandwidth_bps,
            decode=self.decode if decode is None else decode,
        )


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One measured prompt length of a 1P1D profile."""

    prompt_tokens: int
    ttft_s: float
    kv_bytes: int
    transfer_s: float


def read_profile(path: str | Path) -> tuple[ProfileRow, ...]:
    """Rows of a profile CSV; lines starting with '#' are comments."""
    with Path(path).open(encoding="utf-8") as fh:
        lines = [ln for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
    rows = []
    for rec in csv.DictReader(lines):
        rows.append(
            ProfileRow(
                int(rec["prompt_tokens"]),
                float(rec["mean_ttft_ms"]) / 1000.0,
                int(rec["kv_bytes"]),
                float(rec["transfer_ms"]) / 1000.0,
            )
        )
    if len(rows) < 3:
        raise ValueError(f"profile {path} has {len(rows)} rows; at least 3 are needed to fit prefill")
    return tuple(rows)


def fit_truth(path: str | Path = DEFAULT_PROFILE, *, prefill_scale: float = 1.0) -> TruthModel:
    """Fit the prefill quadratic and the transfer link from a profile CSV."""
    rows = read_profile(path)
    lengths = np.array([r.prompt_tokens for r in rows], dtype=float)
    prefill = np.array([r.ttft_s - r.transfer_s for r in rows])
    # Weighted by 1/y so short and long prompts fit to similar relative error.
    design = np.stack([np.ones_like(lengths), lengths, lengths**2], axis=1) / prefill[:, None]
    coef, *_ = np.linalg.lstsq(design, np.ones_like(prefill), rcond=None)
    a, b, c = (max(0.0, float(x)) for x in coef)
    kv_bytes = np.array([r.kv_bytes for r in rows], dtype=float)
    transfer = np.array([r.transfer_s for r in rows])
    lat, per_byte = np.polyfit(kv_bytes, transfer, 1)[::-1]
    largest = max(rows, key=lambda r: r.prompt_tokens)
    return TruthModel(
        prefill_a=a,
        prefill_b=b,
        prefill_c=c,
        prefill_scale=prefill_scale,
        link_latency_s=max(0.0, float(lat)),
        link_bandwidth_bps=1.0 / float(per_byte),
        kv_bytes_per_token=largest.kv_bytes // largest.prompt_tokens,
    )


def truth_from_emulator(profile: EmulatorProfile, time_scale: float = 1.0, kv_capacity_tokens: int = 1_000_000) -> TruthModel:
    """The emulated workers' own timing model as the simulator's truth, so a simulated run and a live
    run through emulators (`adapters.emulator`) time prefill, KV transfer and decode steps by the
    same formulas and coefficients: T_prefill = base + per_token*new + quad*new*(new + 2*cached)
    (the same as this module's a + b*new + c*(ctx^2 - cached^2)), transfer = latency + bytes / bw,
    step = base + per_seq*batch + per_kv*kv. The emulator multiplies every duration by
    `time_scale`; so does this. (The two default fits of the bundled CSV differ by the KV transfer:
    the emulator fits TTFT, fit_truth TTFT minus transfer -- 2-3%; this uses the emulator's.)"""
    return TruthModel(
        prefill_a=profile.prefill_base_s,
        prefill_b=profile.prefill_per_token_s,
        prefill_c=profile.prefill_quad_s,
        prefill_scale=time_scale,
        link_latency_s=profile.transfer_latency_s * time_scale,
        link_bandwidth_bps=profile.transfer_bandwidth_bytes_s / time_scale,
        kv_bytes_per_token=int(profile.kv_bytes_per_token),
        decode=DecodeTruth(
            base_s=profile.decode_base_s * time_scale,
            per_seq_s=profile.decode_per_seq_s * time_scale,
            per_kv_token_s=profile.decode_per_kv_token_s * time_scale,
            kv_capacity_tokens=kv_capacity_tokens,
            max_batch=profile.max_num_seqs,
        ),
    )
