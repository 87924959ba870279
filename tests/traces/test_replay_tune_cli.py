"""`conductor replay --simulate` and `conductor tune-pd` end to end: arguments, tables, JSON, PNG."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from policies.registry import load_policy
from tests.support.ci import require_import
from traces.formats import load_trace, resolve_trace
from traces.replay_cli import replay_main
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.results import result_from_dict
from traces.tune import SweepResult, format_sweep, plateau, recommend, robust_point, tune_main

HEAD = "conversation-head400"


def test_replay_one_policy_writes_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = replay_main(
        [
            HEAD,
            "--simulate",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--policy",
            "round_robin",
            "--paper",
            "--slo-ttft",
            "20",
            "--json",
            str(out),
            "--jobs",
            "1",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "round_robin (simulate)" in text and "TTFT p50/p90/p99" in text and "2P2D" in text
    doc = json.loads(out.read_text())
    (res,) = [result_from_dict(r) for r in doc["results"]]
    assert res.requests == 400 and res.completed + res.rejected == 400
    assert res.slo_ttft_s == 20.0 and res.ttft.p99 >= res.ttft.p50 > 0
    assert set(res.utilisation) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}


def test_replay_compare_side_by_side_with_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.json"
    rc = replay_main(
        [
            HEAD,
            "--prefill",
            "3",
            "--decode",
            "1",
            "--paper",
            "--limit",
            "200",
            "--json",
            str(out),
            "--compare",
            "random,kvcache_aware:admission=none,kvcache_aware:admission=early",
        ]
    )
    assert rc == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.index("random") < header.index("kvcache_aware:admission=none") < header.index("admission=early")
    results = [result_from_dict(r) for r in json.loads(out.read_text())["results"]]
    assert [r.policy for r in results] == ["random", "kvcache_aware:admission=none", "kvcache_aware:admission=early"]
    assert all(r.requests == 200 for r in results)
    assert results[1].rejected == 0 and results[1].ttft_prediction.count == 200


def test_replay_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_main([str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert replay_main([HEAD, "--policy", "no_such_policy", "--limit", "5"]) == 2
    assert "no_such_policy" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 900, "output_length": 4, "hash_ids": [1, 2]}\n'
        "garbage\n"
        '{"timestamp": 500, "input_length": 900, "output_length": 4, "hash_ids": [1, 2]}\n'
    )
    assert replay_main([str(trace), "--prefill", "1", "--decode", "1"]) == 0
    captured = capsys.readouterr()
    assert "line 2" in captured.err and re.search(r"^requests\s+2\s*$", captured.out, re.M)


def test_replay_runs_as_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "traces.replay_cli", HEAD, "--limit", "50", "--prefill", "1", "--decode", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "round_robin (simulate)" in proc.stdout and "completed" in proc.stdout


def test_tune_pd_sweeps_recommends_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    rc = tune_main(
        [
            "synthetic",
            "--nodes",
            "5",
            "--limit",
            "600",
            "--paper",
            "--slo-ttft",
            "10",
            "--slo-tbt",
            "0.1",
            "--plot",
            str(png),
            "--json",
            str(js),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for split in ("1P:4D", "2P:3D", "3P:2D", "4P:1D"):
        assert split in text
    doc = json.loads(js.read_text())
    results = [result_from_dict(r) for r in doc["results"]]
    best = max(results, key=lambda r: (r.slo_met, -r.ttft.mean))
    assert doc["best"] == {"prefill": best.n_prefill, "decode": best.n_decode}
    flat = doc["plateau"]
    assert {"prefill": best.n_prefill, "decode": best.n_decode} in flat
    assert all(
        r.goodput_rps >= 0.99 * best.goodput_rps
        for r in results
        if {"prefill": r.n_prefill} in [{"prefill": f["prefill"]} for f in flat]
    )
    pick = doc["recommended"]
    assert pick == flat[(len(flat) - 1) // 2] or pick == flat[len(flat) // 2]
    assert f"recommended: {pick['prefill']} prefill + {pick['decode']} decode" in text and "plateau" in text
    require_import("matplotlib", "the test extra (or the plot extra) installs matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_sweep(goodputs: list[float]) -> SweepResult:
    base = simulate(load_policy("round_robin"), load_trace(resolve_trace(HEAD), limit=20).requests, SimConfig(1, 1))
    n = len(goodputs) + 1
    results = tuple(
        replace(base, n_prefill=p, n_decode=n - p, goodput_rps=g, slo_met=int(g * 1000)) for p, g in enumerate(goodputs, start=1)
    )
    best = recommend(results)
    flat = plateau(results, best)
    return SweepResult(n, results, best, flat, robust_point(flat))


def test_plateau_and_its_middle() -> None:
    # best at 4P; 3P..7P within 1% of it (2P is 1.5% short, 8P far below)
    s = _fake_sweep([1.0, 1.97, 1.995, 2.0, 1.99, 1.985, 1.991, 1.5, 1.0])
    assert s.best.n_prefill == 4
    assert [r.n_prefill for r in s.plateau] == [3, 4, 5, 6, 7]
    assert s.pick.n_prefill == 5  # the middle, not the peak at one edge of the flat top
    # a split within 1% but cut off from the best by a deeper dip is not on its plateau
    s = _fake_sweep([2.0, 1.9, 1.999])
    assert [r.n_prefill for r in s.plateau] == [1] and s.pick.n_prefill == 1
    # two middles: the one with more goodput
    s = _fake_sweep([1.0, 1.995, 2.0, 1.0])
    assert [r.n_prefill for r in s.plateau] == [2, 3] and s.pick.n_prefill == 3
    text = format_sweep(_fake_sweep([1.0, 1.97, 1.995, 2.0, 1.99, 1.985, 1.991, 1.5, 1.0]))
    assert "plateau (goodput within 1% of the best, 4P:6D" in text and "3P:7D .. 7P:3D (5 splits)" in text
    assert "recommended: 5 prefill + 5 decode" in text


def test_tune_pd_rejects_too_few_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert tune_main([HEAD, "--nodes", "1", "--plot", ""]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_simulation_keeps_its_own_slos_when_none_is_given() -> None:
    # the live replay's default (the demo's 0.5 s / 40 ms) must not leak into simulations
    from traces.replay_cli import build_parser
    from traces.sim.options import config_from_args

    args = build_parser().parse_args(["conversation"])
    assert (args.slo_ttft, args.slo_tbt) == (None, None)
    slo = config_from_args(args, 2, 2).slo
    assert (slo.ttft_s, slo.tbt_s) == (30.0, 0.1)
    slo = config_from_args(build_parser().parse_args(["conversation", "--slo-ttft", "2"]), 2, 2).slo
    assert (slo.ttft_s, slo.tbt_s) == (2.0, 0.1)
