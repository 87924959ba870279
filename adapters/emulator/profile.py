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
from pathlib import Path
from typing import Any

import yaml

from conductor.core.profile import CsvFit, Profile, fit_rows

__all__ = ["DEFAULT_CSV", "CsvFit", "Profile", "fit_csv", "load_profile"]

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "conductor/data/profiles/qwen3-8b-h800-1p1d-vllm-mooncake.csv"


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        lines = [line for line in fh if line.strip() and not line.lstrip().startswith("#")]
    return list(csv.DictReader(lines))


def fit_csv(path: Path) -> CsvFit:
    """The profile's coefficients fitted from a TTFT / transfer table (see conductor.core.profile.fit_rows)."""
    return fit_rows(_read_rows(path), str(path))


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
    for key, value in values.items():  # YAML 1.1 reads 2.0e10 (no exponent sign) as a string
        if key not in ("name", "max_num_seqs") and not isinstance(value, int | float):
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"profile key {key}: {value!r} is not a number") from None
    base: dict[str, Any] = {}
    if csv_path is not None:
        base = dataclasses.asdict(fit_csv(csv_path))
    base.update(values)
    return Profile(**base)
