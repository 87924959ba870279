"""`conductor replay --simulate` and `conductor tune-pd` end to end: arguments, tables, JSON, PNG."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from traces.replay_cli import replay_main
from traces.sim.results import result_from_dict
from traces.tune import tune_main

HEAD = "conversation-head400"


def test_replay_one_policy_writes_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = replay_main([HEAD, "--simulate", "--prefill", "2", "--decode", "2", "--policy", "round_robin",
                      "--paper", "--slo-ttft", "20", "--json", str(out), "--jobs", "1"])
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
    rc = replay_main([HEAD, "--prefill", "3", "--decode", "1", "--paper", "--limit", "200", "--json", str(out),
                      "--compare", "random,kvcache_aware:admission=none,kvcache_aware:admission=early"])
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
    trace.write_text('{"timestamp": 0, "input_length": 900, "output_length": 4, "hash_ids": [1, 2]}\n'
                     "garbage\n"
                     '{"timestamp": 500, "input_length": 900, "output_length": 4, "hash_ids": [1, 2]}\n')
    assert replay_main([str(trace), "--prefill", "1", "--decode", "1"]) == 0
    captured = capsys.readouterr()
    assert "line 2" in captured.err and re.search(r"^requests\s+2\s*$", captured.out, re.M)


def test_replay_runs_as_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "traces.replay_cli", HEAD, "--limit", "50", "--prefill", "1",
                           "--decode", "1"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "round_robin (simulate)" in proc.stdout and "completed" in proc.stdout


def test_tune_pd_sweeps_recommends_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    rc = tune_main(["synthetic", "--nodes", "5", "--limit", "600", "--paper", "--slo-ttft", "10", "--slo-tbt", "0.1",
                    "--plot", str(png), "--json", str(js)])
    assert rc == 0
    text = capsys.readouterr().out
    for split in ("1P:4D", "2P:3D", "3P:2D", "4P:1D"):
        assert split in text
    doc = json.loads(js.read_text())
    results = [result_from_dict(r) for r in doc["results"]]
    best = max(results, key=lambda r: (r.slo_met, -r.ttft.mean))
    assert doc["recommended"] == {"prefill": best.n_prefill, "decode": best.n_decode}
    assert f"recommended: {best.n_prefill} prefill + {best.n_decode} decode" in text
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_pd_rejects_too_few_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert tune_main([HEAD, "--nodes", "1", "--plot", ""]) == 2
    assert "at least 2" in capsys.readouterr().err
