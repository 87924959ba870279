"""benchmarks/capacity.py reads capacity at SLO off attainment curves (bench_live_vs_peers.py
--capacity): the interpolation, its spread over sweeps, the ratios to the best peer, the sweep
order, and the table and plot redrawn from a saved --json run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_live_vs_peers import main
from benchmarks.capacity import Capacity, Curve, capacity_rows, crossing, paired_ratios, ratio_text, sweep


def test_the_crossing_is_interpolated_between_the_last_rate_at_target_and_the_next() -> None:
    # 95% at 4x, 85% at 6x: 90% is halfway, at 5x
    found = crossing([2, 4, 6, 8], [1.0, 0.95, 0.85, 0.5])
    assert found.bound == "=" and found.rate == pytest.approx(5.0)
    # not halfway: 92% at 2x, 80% at 3x -> 2 + (0.92 - 0.9) / (0.92 - 0.80) = 2.1667x
    assert crossing([1, 2, 3], [1.0, 0.92, 0.80]).rate == pytest.approx(2 + 0.02 / 0.12)
    # the rates in any order
    assert crossing([3, 1, 2], [0.80, 1.0, 0.92]).rate == pytest.approx(2 + 0.02 / 0.12)
    # exactly at the target counts as met
    assert crossing([2, 4, 6], [1.0, 0.9, 0.7]) == Capacity(4.0)


def test_a_dip_below_the_target_before_a_higher_rate_meets_it_again_is_not_the_crossing() -> None:
    # 85% at 2x, back to 93% at 3x: the last rate at target is 3x, the crossing towards 50% at 4x
    assert crossing([1, 2, 3, 4], [0.95, 0.85, 0.93, 0.5]).rate == pytest.approx(3 + 0.03 / 0.43)


def test_a_curve_that_never_crosses_only_bounds_the_capacity() -> None:
    assert crossing([2, 4, 6], [1.0, 0.97, 0.91]) == Capacity(6.0, ">=")
    assert crossing([2, 4, 6], [0.89, 0.5, 0.2]) == Capacity(2.0, "<")
    assert Capacity(6.0, ">=").text() == ">=6" and Capacity(2.0, "<").text() == "<2"
    with pytest.raises(ValueError):
        crossing([2, 2], [1.0, 0.5])
    with pytest.raises(ValueError):
        crossing([2, 4], [1.0])


def test_the_median_curve_gives_the_capacity_and_each_sweep_its_spread() -> None:
    curve = Curve((2.0, 4.0, 6.0), ((1.0, 1.0, 0.95), (0.95, 0.9, 0.85), (0.6, 0.8, 0.7)))
    assert curve.median() == [1.0, 0.9, 0.7]
    assert curve.capacity() == Capacity(4.0)
    # sweep 0: 95% -> 60% from 4x to 6x; sweep 1: 90% at 4x; sweep 2: 95% -> 85% from 2x to 4x
    per_run = curve.per_run()
    assert [c.rate for c in per_run] == pytest.approx([4 + 2 * 0.05 / 0.35, 4.0, 2 + 2 * 0.05 / 0.10])
    low, high = curve.spread()
    assert low.rate == pytest.approx(3.0) and high.rate == pytest.approx(4 + 2 * 0.05 / 0.35)


def test_ratios_say_which_way_a_censored_capacity_leaves_them() -> None:
    assert ratio_text(Capacity(6.0), Capacity(4.0)) == "1.50x"
    assert ratio_text(Capacity(6.0, ">="), Capacity(4.0)) == ">=1.50x"
    assert ratio_text(Capacity(6.0), Capacity(4.0, ">=")) == "<=1.50x"
    assert ratio_text(Capacity(2.0, "<"), Capacity(4.0)) == "<=0.50x"
    assert ratio_text(Capacity(6.0, ">="), Capacity(4.0, ">=")) == "?"
    a = Curve((2.0, 4.0), ((1.0, 1.0), (0.8, 0.85)))  # sweeps: 2 + 0.1/0.2 * 2 = 3.0, 2 + 0.1/0.15 * 2
    b = Curve((2.0, 4.0), ((0.95, 0.95), (0.85, 0.85)))  # 3.0 in both sweeps
    assert paired_ratios(a, b) == pytest.approx([1.0, (2 + 0.2 / 0.15) / 3.0])


def test_the_table_has_a_row_per_rate_then_the_capacities_and_ratios_to_the_best_peer() -> None:
    curves = {
        "conductor kv+adm": Curve((2.0, 4.0, 6.0), ((1.0,), (0.95,), (0.85,))),  # 5x
        "vllm-router rr": Curve((2.0, 4.0, 6.0), ((0.95,), (0.85,), (0.5,))),  # 3x
        "vllm-router cache": Curve((2.0, 4.0, 6.0), ((1.0,), (0.9,), (0.5,))),  # 4x: the best peer
    }
    headers, rows, best = capacity_rows(curves, ["vllm-router rr", "vllm-router cache"], base_rps=2.0)
    assert best == "vllm-router cache"
    assert headers == ["speed-up (rate)", *curves]
    assert rows[0] == ["2x (4.0 req/s)", "100%", "95%", "100%"]
    table = {row[0]: row[1:] for row in rows}
    assert table["capacity at 90% (speed-up)"] == ["5.00", "3.00", "4.00"]
    assert table["capacity, req/s"] == ["10.0", "6.0", "8.0"]
    assert table["/ best peer (vllm-router cache)"] == ["1.25x", "0.75x", "1.00x"]


@dataclass(frozen=True)
class _Router:
    name: str


def test_each_sweep_reverses_the_router_and_rate_order_of_the_last() -> None:
    calls: list[tuple[str, float]] = []

    def measure(router: _Router, rate: float) -> dict[str, Any]:
        calls.append((router.name, rate))
        return {"slo_attainment": len(calls)}

    out = sweep([_Router("a"), _Router("b")], [4.0, 2.0], 2, measure)
    assert calls == [("a", 2), ("b", 2), ("a", 4), ("b", 4), ("b", 4), ("a", 4), ("b", 2), ("a", 2)]
    assert [r["slo_attainment"] for r in out["2"]["runs"]["a"]] == [1, 8]  # run j is sweep j


def test_a_saved_run_is_redrawn_as_a_table_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = {
        "2": {"conductor kv+adm": [1.0, 0.98], "vllm-router rr": [0.95, 0.9]},
        "4": {"conductor kv+adm": [0.95, 0.93], "vllm-router rr": [0.6, 0.7]},
        "6": {"conductor kv+adm": [0.7, 0.75], "vllm-router rr": [0.3, 0.2]},
    }
    saved = {
        "header": ["120 requests of a trace", "versions: test", "profiles: test"],
        "base_rps": 2.5,
        "missing": {"conductor rr+adm": "no live configuration"},
        "rates": {r: {"runs": {n: [{"slo_attainment": a} for a in att] for n, att in cell.items()}} for r, cell in runs.items()},
    }
    path, png = tmp_path / "cap.json", tmp_path / "cap.png"
    path.write_text(json.dumps(saved), encoding="utf-8")
    assert main(["--capacity", "--from-json", str(path), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "| speed-up (rate) | conductor kv+adm | vllm-router rr |" in printed
    assert "| 4x (10.0 req/s) | 94% (93%..95%) | 65% (60%..70%) |" in printed
    assert "/ best peer (vllm-router rr)" in printed and "conductor rr+adm: left out" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
