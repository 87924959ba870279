"""The latency profile: how long a prefill, a decode step and a KV transfer take on one engine.

Pure values and arithmetic, shared by the emulated workers (`adapters/emulator/profile.py` reads
profile files into a `Profile`) and the simulator's ground truth (`traces/sim/truth.py`). The
coefficients' meaning and the file format are documented in `adapters/emulator/profile.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Profile:
    """Timing coefficients, all in seconds (before time scaling and noise)."""

    name: str = "qwen3-8b-h800"
    prefill_base_s: float = 0.0448  # fixed cost of a prefill step (scheduling, sampling, launch)
    prefill_per_token_s: float = 2.0e-5  # linear cost per newly computed token (MLPs, projections)
    prefill_quad_s: float = 4.6e-11  # attention cost per (new token x context token) pair
    kv_bytes_per_token: float = 147456.0  # bytes of KV one token occupies (all layers)
    transfer_latency_s: float = 0.00038  # fixed cost of one KV transfer
    transfer_bandwidth_bytes_s: float = 1.46e11  # effective KV transfer bandwidth
    decode_base_s: float = 0.008  # one decode step with an empty batch
    decode_per_seq_s: float = 0.00015  # added per running sequence
    decode_per_kv_token_s: float = 2.0e-7  # added per resident KV token across the batch
    max_num_seqs: int = 256  # running batch limit

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """T_prefill for `new_tokens` computed on top of `cached_tokens` already in cache."""
        n = max(new_tokens, 0)
        return self.prefill_base_s + self.prefill_per_token_s * n + self.prefill_quad_s * n * (n + 2 * cached_tokens)

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        """One continuous-batching decode step for `batch` sequences holding `kv_tokens` in total."""
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_kv_token_s * kv_tokens

    def kv_bytes(self, tokens: int) -> float:
        return self.kv_bytes_per_token * max(tokens, 0)

    def transfer_s(self, tokens: int) -> float:
        """Moving the KV of `tokens` tokens between instances (zero when there is nothing to move)."""
        if tokens <= 0:
            return 0.0
        return self.transfer_latency_s + self.kv_bytes(tokens) / self.transfer_bandwidth_bytes_s


@dataclass(frozen=True, slots=True)
class CsvFit:
    """Coefficients fitted from a TTFT / transfer table."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_quad_s: float
    kv_bytes_per_token: float
    transfer_latency_s: float
    transfer_bandwidth_bytes_s: float


def fit_rows(rows: Sequence[Mapping[str, str]], source: str = "profile") -> CsvFit:
    """Least squares in relative error (each row weighted by 1/observed), coefficients clipped at 0.

    `rows` are a profile table's rows (columns prompt_tokens, mean_ttft_ms, kv_bytes, transfer_ms).
    Relative weighting keeps the short prompts (tens of ms) as well fitted as the long ones. numpy's
    lstsq rather than scipy's nnls: importing scipy.optimize costs 0.3 s at every emulator start,
    and on the bundled table every coefficient comes out positive anyway.
    """
    if len(rows) < 3:
        raise ValueError(f"{source}: need at least 3 rows to fit a quadratic, got {len(rows)}")
    n = np.array([float(r["prompt_tokens"]) for r in rows])
    ttft = np.array([float(r["mean_ttft_ms"]) for r in rows]) / 1000.0
    weights = 1.0 / ttft
    design = np.stack([np.ones_like(n), n, n * n], axis=1)
    base, per_token, quad = np.clip(np.linalg.lstsq(design * weights[:, None], ttft * weights, rcond=None)[0], 0, None)
    kv_bytes = np.array([float(r["kv_bytes"]) for r in rows])
    transfer = np.array([float(r["transfer_ms"]) for r in rows]) / 1000.0
    # bytes per token: slope through the origin (KV grows linearly with tokens).
    per_token_bytes = float(np.dot(kv_bytes, n) / np.dot(n, n))
    tdesign = np.stack([np.ones_like(kv_bytes), kv_bytes], axis=1)
    latency, inv_bw = np.clip(np.linalg.lstsq(tdesign / transfer[:, None], np.ones_like(transfer), rcond=None)[0], 0, None)
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float("inf")
    return CsvFit(float(base), float(per_token), float(quad), per_token_bytes, float(latency), float(bandwidth))
