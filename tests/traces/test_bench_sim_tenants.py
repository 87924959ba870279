"""benchmarks/bench_sim_tenants.py runs bench_tenants.py's scenarios with its settings on the simulator
and prints its tables (it imports bench_tenants.py's settings and tables: a change there shows here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_sim_tenants import SIM_COLUMN, main


def test_a_short_run_prints_every_scenario_and_the_goals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["--capacity", "5", "--duration", "8", "--repeat", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for scenario in ("1.5x", "3x", "share", "flood"):
        assert f"\n{scenario} " in printed
    assert "tenant A loses" in printed
    found = json.loads(out.read_text(encoding="utf-8"))
    runs = found["runs"][SIM_COLUMN]
    assert len(runs) == 2 and set(runs[0]) == {"1.5x", "3x", "share", "flood"}
    # beside a live run's JSON (here the simulated one, relabelled), the figures are compared
    live = tmp_path / "live.json"
    live.write_text(json.dumps({"runs": {"conductor": runs}}), encoding="utf-8")
    assert main(["--capacity", "5", "--duration", "8", "--repeat", "2", "--live", str(live)]) == 0
    assert "sim-live" in capsys.readouterr().out
