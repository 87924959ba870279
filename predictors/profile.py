"""Offline fit: measurement CSVs in, `PredictorParams` out.

A profile CSV has a header row; lines starting with '#' are comments. Columns are recognised by
name, so one file may carry any of the three kinds of measurement:

* prefill: `prompt_tokens` and one of `prefill_ms`, `mean_ttft_ms`, `ttft_ms`; optional
  `cached_tokens` (default 0) and `transfer_ms`.
* transfer: `kv_bytes` and `transfer_ms` (the P -> D handoff of the prompt's KV).
* decode: `batch_size`, `resident_kv_tokens` and `tbt_ms`.

Why `transfer_ms` is subtracted from a TTFT column: the bundled Qwen3-8B/H800 profile measures TTFT
end to end through a 1P1D pair (proxy, prefill on P, KV transfer P -> D, first decode step). The
scheduler predicts the P -> D transfer separately with the transfer model (it depends on the link,
not on the prefill instance), so T_prefill is fitted to TTFT - transfer_ms and the predicted TTFT of a
disaggregated request adds the handoff back. The remaining fixed costs (proxy, first decode step)
stay in T_prefill's constant term. A `prefill_ms` column is taken as is.

KV bytes per token is the zero-intercept least-squares slope of kv_bytes on prompt_tokens (the
published sizes are rounded, so the large rows dominate, as they should). The store link has no
measurements in the bundled profile: it starts as a copy of the instance link, because Mooncake Store
reads go through the same Transfer Engine over the same NICs, and is noted as such in the params.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from predictors.linear import FitOptions, LinearModel, fit_linear
from predictors.params import (
    INSTANCE_LINK,
    STORE_LINK,
    DecodePrior,
    PredictorParams,
    prefill_features,
    tbt_features,
    transfer_features,
)

BUNDLED_PROFILE = "qwen3-8b-h800-1p1d-vllm-mooncake.csv"
_TTFT_COLUMNS = ("prefill_ms", "mean_ttft_ms", "ttft_ms")


class ProfileError(ValueError):
    """A profile CSV is missing, unreadable or holds nothing to fit."""


def bundled_profile() -> Path:
    """Path of the profile shipped in the `conductor` package data."""
    return Path(str(resources.files("conductor").joinpath("data", "profiles", BUNDLED_PROFILE)))


def read_profile(path: str | Path) -> list[dict[str, float]]:
    """Rows of a profile CSV as floats; non-numeric columns (labels, units) are dropped."""
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(line for line in fh if line.strip() and not line.lstrip().startswith("#"))
            rows: list[dict[str, float]] = []
            for raw in reader:
                row: dict[str, float] = {}
                for key, value in raw.items():
                    if key is None or value is None:
                        continue
                    try:
                        row[key.strip()] = float(value)
                    except ValueError:
                        continue
                rows.append(row)
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    return rows


def _fit_prefill(rows: Sequence[dict[str, float]], options: FitOptions) -> LinearModel | None:
    feats, ys = [], []
    for row in rows:
        col = next((c for c in _TTFT_COLUMNS if c in row), None)
        if col is None or "prompt_tokens" not in row:
            continue
        ms = row[col] - (row.get("transfer_ms", 0.0) if col != "prefill_ms" else 0.0)
        cached = row.get("cached_tokens", 0.0)
        feats.append(prefill_features(row["prompt_tokens"] - cached, cached))
        ys.append(ms / 1000.0)
    return fit_linear(feats, ys, options=options) if len(ys) >= 3 else None


def _fit_transfer(rows: Sequence[dict[str, float]], options: FitOptions) -> LinearModel | None:
    pairs = [(r["kv_bytes"], r["transfer_ms"] / 1000.0) for r in rows if "kv_bytes" in r and "transfer_ms" in r]
    if len(pairs) < 2:
        return None
    return fit_linear([transfer_features(b) for b, _ in pairs], [t for _, t in pairs], options=options)


def _fit_tbt(rows: Sequence[dict[str, float]], prior: LinearModel, options: FitOptions) -> LinearModel | None:
    keys = ("batch_size", "resident_kv_tokens", "tbt_ms")
    data = [r for r in rows if all(k in r for k in keys)]
    if len(data) < 3:
        return None
    feats = [tbt_features(r["batch_size"], r["resident_kv_tokens"]) for r in data]
    return fit_linear(feats, [r["tbt_ms"] / 1000.0 for r in data], prior=prior.coef, options=options)


def kv_bytes_per_token(rows: Sequence[dict[str, float]]) -> float | None:
    pairs = [(r["prompt_tokens"], r["kv_bytes"]) for r in rows if "prompt_tokens" in r and "kv_bytes" in r]
    sxx = sum(n * n for n, _ in pairs)
    return sum(n * b for n, b in pairs) / sxx if sxx > 0 else None


def fit_profiles(
    paths: Sequence[str | Path],
    *,
    kv_bytes: float | None = None,
    decode_prior: DecodePrior | None = None,
    options: FitOptions | None = None,
) -> PredictorParams:
    """Fit every model the CSVs have data for; raise ProfileError if prefill or transfer has none."""
    decode_prior = decode_prior or DecodePrior()
    options = options or FitOptions()
    rows = [row for p in paths for row in read_profile(p)]
    prefill = _fit_prefill(rows, options)
    if prefill is None:
        raise ProfileError(f"no prefill rows (prompt_tokens + one of {_TTFT_COLUMNS}) in {list(map(str, paths))}")
    transfer = _fit_transfer(rows, options)
    if transfer is None:
        raise ProfileError(f"no transfer rows (kv_bytes + transfer_ms) in {list(map(str, paths))}")
    per_token = kv_bytes if kv_bytes is not None else kv_bytes_per_token(rows)
    if per_token is None or per_token <= 0:
        raise ProfileError("KV bytes per token: give kv_bytes, or a profile with prompt_tokens and kv_bytes")
    prior = decode_prior.model(per_token)
    # a light prior: measured rows should decide every direction they vary, the prior only the rest
    tbt = _fit_tbt(rows, prior, FitOptions(options.loss, options.f_scale, options.mad_k, prior_weight=0.05))
    notes = {
        "prefill": "fitted to TTFT - transfer_ms (P->D handoff predicted separately)",
        "store_link": "copy of the instance link: no store measurements in the profile",
        "tbt": "fitted to decode rows" if tbt is not None else "roofline prior (DecodePrior), refitted online",
    }
    return PredictorParams(
        prefill=prefill,
        transfer=MappingProxyType({INSTANCE_LINK: transfer, STORE_LINK: transfer}),
        tbt=tbt if tbt is not None else prior,
        kv_bytes_per_token=per_token,
        source=",".join(str(p) for p in paths),
        notes=MappingProxyType(notes),
    )
