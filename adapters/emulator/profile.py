"""The emulated worker's timing model: how long a prefill, a decode step and a KV transfer take.

Profile file format (YAML or JSON; every key optional, missing keys keep the default):

```yaml
name: qwen3-8b-h800                 # free text, shown in /v1/models metadata and logs
calibrate_csv: path/to/profile.csv  # columns prompt_tokens, mean_ttft_ms, kv_bytes, transfer_ms:
                                    # refits prefill_*, transfer_* and kv_bytes_per_token from it
prefill_base_s: 0.0448              # T_prefill(n new, c cached) =
prefill_per_token_s: 2.0e-5         #   base + per_token * n + quad * n * (n + 2c)
prefill_quad_s: 4.59e-11            #   (attention: each new token attends to c cached + earlier new ones)
kv_bytes_per_token: 147456          # KV footprint of one token (all layers), bytes
transfer_latency_s: 0.00038         # T_transfer(bytes) = latency + bytes / bandwidth
transfer_bandwidth_bytes_s: 1.46e11
decode_base_s: 0.008                # TBT(batch, kv) = base + per_seq * batch + per_kv_token * kv
decode_per_seq_s: 0.00015
decode_per_kv_token_s: 2.0e-7
max_num_seqs: 256                   # running batch limit (vLLM --max-num-seqs)
```

The default profile is fitted at load from the bundled Qwen3-8B / H800 1P1D measurement
(`conductor/data/profiles/qwen3-8b-h800-1p1d-vllm-mooncake.csv`): a quadratic in prompt length fits
its mean TTFT within 8% at every length and within 0.1% at 8,192 tokens (0.212 s). There is no
published decode measurement; the decode defaults are a documented guess for an 8B model on an H800
(8 ms per step, +0.15 ms per running sequence, +0.2 ms per 1,000 resident KV tokens).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "conductor/data/profiles/qwen3-8b-h800-1p1d-vllm-mooncake.csv"


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


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        lines = [line for line in fh if line.strip() and not line.lstrip().startswith("#")]
    return list(csv.DictReader(lines))


def fit_csv(path: Path) -> CsvFit:
    """Least squares in relative error (each row weighted by 1/observed), coefficients clipped at 0.

    Relative weighting keeps the short prompts (tens of ms) as well fitted as the long ones. numpy's
    lstsq rather than scipy's nnls: importing scipy.optimize costs 0.3 s at every emulator start,
    and on the bundled table every coefficient comes out positive anyway.
    """
    rows = _read_rows(path)
    if len(rows) < 3:
        raise ValueError(f"{path}: need at least 3 rows to fit a quadratic, got {len(rows)}")
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


def load_profile(path: str | Path | None = None) -> Profile:
    """The default profile (fitted from the bundled CSV), or one read from a YAML/JSON file."""
    values: dict[str, Any] = {}
    csv_path: Path | None = DEFAULT_CSV if DEFAULT_CSV.exists() else None
    if path is not None:
        p = Path(path)
        text = p.read_text()
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: a profile is a mapping of keys to values")
        values = dict(raw)
        if "calibrate_csv" in values:
            calib = values.pop("calibrate_csv")
            csv_path = (p.parent / calib) if calib and not Path(calib).is_absolute() else (Path(calib) if calib else None)
        elif any(k.startswith(("prefill_", "transfer_", "kv_bytes")) for k in values):
            csv_path = None  # explicit coefficients: no refit behind the user's back
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown profile keys: {sorted(unknown)}")
    base: dict[str, Any] = {}
    if csv_path is not None:
        base = dataclasses.asdict(fit_csv(csv_path))
    base.update(values)
    return Profile(**base)
