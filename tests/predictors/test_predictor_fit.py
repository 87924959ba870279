"""Offline fit from the bundled profile, params JSON round trip, the fit CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from predictors import PredictorParams, Predictors, bundled_profile, fit_profiles
from predictors.cli import fit_main
from predictors.profile import read_profile


@pytest.fixture(scope="module")
def params() -> PredictorParams:
    return fit_profiles([bundled_profile()])


def test_profile_ttft_fits_within_3_percent_mape(params: PredictorParams) -> None:
    # predicted end-to-end 1P1D TTFT = prefill (cached 0) + P->D handoff of the prompt's KV
    pred = Predictors(params)
    rows = read_profile(bundled_profile())
    assert len(rows) == 9
    errors = []
    for row in rows:
        n = int(row["prompt_tokens"])
        predicted = pred.prefill_s(n, 0) + pred.transfer_s(n)
        errors.append(abs(predicted - row["mean_ttft_ms"] / 1e3) / (row["mean_ttft_ms"] / 1e3))
    mape = sum(errors) / len(errors)
    assert mape <= 0.03, f"TTFT MAPE {mape:.2%}"


def test_prefill_model_is_quadratic_and_charges_attention_over_cached_context(
    params: PredictorParams,
) -> None:
    c0, c1, c2 = params.prefill.coef
    assert c0 > 0 and c1 > 0 and c2 > 0  # fixed cost, per-token work, attention all fitted positive
    pred = Predictors(params)
    # a cached prefix saves most of the work, but attention over it still costs something
    full = pred.prefill_s(8192, 0)
    tail = pred.prefill_s(1024, 7168)
    assert tail < full / 3
    assert tail > pred.prefill_s(1024, 0)


def test_transfer_and_kv_size_fitted_from_profile(params: PredictorParams) -> None:
    assert params.kv_bytes_per_token == pytest.approx(147456, rel=0.02)  # Qwen3-8B: 144 KiB a token
    pred = Predictors(params)
    for row in read_profile(bundled_profile()):
        got = pred.transfer_s(int(row["prompt_tokens"]))
        assert got == pytest.approx(row["transfer_ms"] / 1e3, rel=0.25)
    # the big rows show the link's bandwidth: ~140 GB/s on 8x CX-7
    _latency, b = params.transfer["instance"].coef
    assert 100e9 < 1 / b < 200e9
    assert params.transfer["store"] == params.transfer["instance"]


def test_tbt_prior_without_decode_rows(params: PredictorParams) -> None:
    assert params.tbt.samples == 0  # no decode rows: the roofline prior
    d0, _d1, d2 = params.tbt.coef
    assert d0 == pytest.approx(16.4e9 / 3.35e12)
    assert d2 == pytest.approx(params.kv_bytes_per_token / 3.35e12)


def test_decode_rows_are_fitted(tmp_path: Path) -> None:
    csv = tmp_path / "decode.csv"
    lines = ["batch_size,resident_kv_tokens,tbt_ms"]
    for b in (1, 4, 16, 64):
        for kv in (1000, 20000, 200000):
            lines.append(f"{b},{kv},{(8.0 + 0.05 * b + 2e-5 * kv):.5f}")
    csv.write_text("\n".join(lines) + "\n")
    fitted = fit_profiles([bundled_profile(), csv])
    assert fitted.tbt.samples == 12
    assert fitted.tbt.coef == pytest.approx((8e-3, 5e-5, 2e-8), rel=0.05)


def test_params_round_trip_and_cli(tmp_path: Path, params: PredictorParams, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "params.json"
    assert fit_main(["-o", str(out)]) == 0
    assert "MAPE" in capsys.readouterr().out
    loaded = PredictorParams.load(out)
    assert loaded.prefill.coef == pytest.approx(params.prefill.coef)
    assert loaded.to_dict() == json.loads(out.read_text())
    # the module entry point works too
    out2 = tmp_path / "p2.json"
    cmd = [sys.executable, "-m", "predictors.cli", "-o", str(out2)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert PredictorParams.load(out2).prefill.coef == pytest.approx(params.prefill.coef)


def test_cli_rejects_profile_without_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("# nothing useful\nfoo,bar\n1,2\n")
    assert fit_main([str(bad), "-o", str(tmp_path / "x.json")]) == 2
    assert "no prefill rows" in capsys.readouterr().err
    assert fit_main([str(tmp_path / "missing.csv"), "-o", str(tmp_path / "x.json")]) == 2


def test_params_version_checked(tmp_path: Path, params: PredictorParams) -> None:
    data = params.to_dict()
    data["version"] = 99
    with pytest.raises(ValueError, match="version"):
        PredictorParams.from_dict(data)


def test_scaled_params_multiply_every_time(params: PredictorParams) -> None:
    big = Predictors(params.scaled(prefill=4.0, tbt=2.0))
    small = Predictors(params)
    assert big.prefill_s(8000, 1000) == pytest.approx(4 * small.prefill_s(8000, 1000))
    assert big.tbt_s(32, 100_000) == pytest.approx(2 * small.tbt_s(32, 100_000))
    assert big.transfer_s(8000) == pytest.approx(small.transfer_s(8000))
    assert "prefill x4" in big.params.notes["scaled"]
