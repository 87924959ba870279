"""`conductor demo` as a user runs it: a real subprocess that starts emulators and a gateway as its
own children, replays a trace slice, prints the table, and leaves no process behind, whether it
finishes, fails to start, or is interrupted (SIGINT, SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.support.ports import free_port_run
from tests.support.prom import scrape
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]
FAST = ["--speedup", "8", "--length-scale", "0.0625", "--no-progress"]


def _demo(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "conductor", "demo", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _pids(stderr: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^demo: (\S+) pid (\d+) on ", stderr, re.M)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # still in the table: only acceptable as a zombie nobody could have reaped but us
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1].startswith("Z")


def _row(table: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}\s{{2,}}(.+?)\s*$", table, re.M)
    assert match, f"no row {label!r} in:\n{table}"
    return match.group(1)


def _answered(gateway_url: str) -> float:
    try:
        return scrape(gateway_url, "conductor_requests_total")
    except httpx.HTTPError:  # a refused connection: the loop tries again
        return 0.0


def _seconds(text: str) -> float:
    return float(text[:-2]) / 1000 if text.endswith("ms") else float(text[:-1])


def _with_logs(stderr: str, logs: Path) -> str:
    """The demo's stderr and the end of each process's log: what a failure in CI is read from."""
    tails = [
        f"--- {log.name} (last 3,000 characters)\n{log.read_text(errors='replace')[-3000:]}" for log in sorted(logs.glob("*.log"))
    ]
    return "\n".join([stderr, *tails])


def test_demo_prints_the_table_and_leaves_no_process(tmp_path: Path) -> None:
    out, logs = tmp_path / "demo.json", tmp_path / "logs"
    proc = _demo("--requests", "30", "--json", str(out), "--keep-logs", str(logs), *FAST)
    # in CI this runs beside real vLLM engines' start-ups, which slowed its cluster's start 25-fold
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, _with_logs(stderr, logs)
    pids = _pids(stderr)
    assert set(pids) == {"prefill-0", "prefill-1", "decode-0", "decode-1", "gateway"}
    assert all(_gone(pid) for pid in pids.values()), pids
    assert "kvcache_aware (live)" in stdout
    assert _row(stdout, "cluster") == "2P2D" and _row(stdout, "requests") == "30"
    completed = int(_row(stdout, "completed"))
    rejected_row = _row(stdout, "rejected")  # "11 (ttft_slo=11)"
    rejected = int(rejected_row.split()[0])
    errors = int(_row(stdout, "errors").split()[0])
    assert completed + rejected + errors == 30 and completed > 0 and errors == 0
    # how many admission turns away follows the box's speed (a CI run beside vLLM start-ups: 11 of
    # 30, 2 on a quiet one), but only ever for an SLO it predicted missed
    reasons = dict(kv.split("=") for kv in re.findall(r"(\w+=\d+)", rejected_row))
    assert set(reasons) <= {"ttft_slo", "tbt_slo"} and sum(map(int, reasons.values())) == rejected, rejected_row
    doc = json.loads(out.read_text())
    assert doc["processes"] == pids
    result = doc["results"][0]
    # the latencies shown are the ones the replay measured (no bound on how fast this box is)
    for label, key in (("TTFT p50/p90/p99", "ttft"), ("TBT p50/p90/p99", "tbt")):
        shown = [_seconds(x) for x in _row(stdout, label).split(" / ")]
        measured = [result[key][q] for q in ("p50", "p90", "p99")]
        assert 0 < shown[0] <= shown[1] <= shown[2], (label, shown)
        for s, m in zip(shown, measured, strict=True):  # as printed: 0.1 ms under a second, else 0.01 s
            assert s == pytest.approx(m, abs=5.1e-5 if m < 1 else 5.1e-3), (label, shown, measured)
    assert result["completed"] == completed and result["extra"]["hit_rate_from_gateway"] == 1.0
    assert result["goodput_rps"] > 0
    # KV awareness on: the index's predicted cache hits are what the workers then reported
    assert "KV index pred./reported cached" in stdout
    assert result["extra"]["gateway_kv_hash_agreement"] > 0.9


def test_compare_runs_each_policy_on_a_fresh_cluster_and_prints_them_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    base = free_port_run(13)  # 2P2D over NIXL: the gateway, then HTTP, KV events, side channel per worker
    proc = _demo("--requests", "24", "--compare", "round_robin", "--json", str(out), "--base-port", str(base), *FAST)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    # two clusters, one after the other, each stopped before the next started
    starts = re.findall(r"^demo: gateway pid (\d+) on ", stderr, re.M)
    assert len(starts) == 2 and starts[0] != starts[1]
    # both on the ports given: the gateway on the base port, the workers' HTTP ports after it
    urls = re.findall(r"^demo: (\S+) pid \d+ on http://127\.0\.0\.1:(\d+)$", stderr, re.M)
    first = dict(urls[:5])
    assert dict(urls[5:]) == first and first["gateway"] == str(base)
    assert sorted(int(first[n]) for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")) == [
        base + 1 + 3 * i for i in range(4)
    ]
    assert "through kvcache_aware at" in stderr and "through round_robin at" in stderr
    header = next(line for line in stdout.splitlines() if "kvcache_aware (live)" in line)
    assert header.index("kvcache_aware (live)") < header.index("round_robin (live)")
    for label in ("requests", "completed", "goodput", "TTFT p50/p90/p99", "SLO met", "errors"):
        values = re.split(r"\s{2,}", _row(stdout, label))
        assert len(values) == 2, (label, values)  # one column per policy, lined up
    assert re.split(r"\s{2,}", _row(stdout, "requests")) == ["24", "24"]
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["results"]] == ["kvcache_aware", "round_robin"]
    goodputs = [r["goodput_rps"] for r in doc["results"]]
    ratio = re.search(r"^goodput kvcache_aware / round_robin: ([\d.]+)x$", stdout, re.M)
    assert ratio and goodputs[1] > 0 and float(ratio.group(1)) == pytest.approx(goodputs[0] / goodputs[1], abs=0.006)
    every = [int(pid) for pid in re.findall(r"^demo: \S+ pid (\d+) on ", stderr, re.M)]
    assert len(every) == 10 and all(_gone(pid) for pid in every)
    # each cluster's ready time counts from its own start, not the demo's: the second started
    # after the first's replay, and what it printed is its own start-up, as the JSON records it
    clusters = doc["clusters"]
    assert [c["policy"] for c in clusters] == ["kvcache_aware", "round_robin"]
    assert clusters[1]["started_s"] > clusters[0]["ready_s"]
    printed = [float(x) for x in re.findall(r" ready after ([\d.]+)s; replaying", stderr)]
    for shown, cluster in zip(printed, clusters, strict=True):
        assert cluster["ready_after_s"] == pytest.approx(cluster["ready_s"] - cluster["started_s"], abs=0.002)
        assert shown == pytest.approx(cluster["ready_after_s"], abs=0.051)


def test_a_taken_base_port_is_refused_before_anything_starts() -> None:
    base = free_port_run(13)
    with socket.socket() as taken:  # a server already listening on one of the ports the cluster needs
        taken.bind(("127.0.0.1", base + 7))
        taken.listen()
        proc = _demo("--requests", "5", "--base-port", str(base), *FAST)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"port {base + 7} is taken" in stderr and f"{base}-{base + 12}" in stderr, stderr
    assert not _pids(stderr)  # refused before any process started


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_demo_stops_every_child(sig: signal.Signals, tmp_path: Path) -> None:
    proc = _demo("--requests", "200", "--speedup", "1", "--keep-logs", str(tmp_path / "logs"), "--no-progress")
    assert proc.stderr is not None
    seen = ""
    # a guard against a hang, not a bound on start-up: beside vLLM start-ups a CI box took 82 s
    guard = threading.Timer(300, proc.kill)
    guard.start()
    try:
        while "replaying" not in seen:  # the cluster is up and the replay has begun
            line = proc.stderr.readline()
            assert line, seen  # the demo exited (or the guard killed it) before replaying
            seen += line
    finally:
        guard.cancel()
    pids = _pids(seen)
    assert len(pids) == 5 and not any(_gone(p) for p in pids.values())
    # interrupted mid-replay: once the gateway has answered a request, not after a guessed delay
    gateway = re.search(r" through \S+ at (http://\S+)", seen)
    assert gateway, seen
    assert wait_for(lambda: _answered(gateway.group(1)) > 0, timeout=120), "the replay never reached the gateway"
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=90)
    assert proc.returncode == 1
    assert "interrupted" in rest and f"logs of every process are in {tmp_path / 'logs'}" in rest
    assert all(_gone(pid) for pid in pids.values()), pids


def test_failed_start_says_where_the_logs_are(tmp_path: Path) -> None:
    proc = _demo("--requests", "5", "--policy", "no_such_policy", "--keep-logs", str(tmp_path), *FAST)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "gateway" in stderr and "exited" in stderr and "no_such_policy" in stderr
    assert f"logs of every process are in {tmp_path}" in stderr
    assert (tmp_path / "gateway.log").exists()
    assert all(_gone(pid) for pid in _pids(stderr).values())


def test_policy_options_reach_the_gateway_and_a_malformed_spec_starts_nothing(tmp_path: Path) -> None:
    # an option the policy refuses stops the gateway's start-up: so the option got there
    proc = _demo("--requests", "5", "--policy", "kvcache_aware:listed_candidates=0", "--keep-logs", str(tmp_path), *FAST)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "listed_candidates" in (tmp_path / "gateway.log").read_text()
    assert all(_gone(pid) for pid in _pids(stderr).values())
    proc = _demo("--requests", "5", "--compare", "round_robin,kvcache_aware:ttft_slack", *FAST)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "'ttft_slack'" in stderr and "key=value" in stderr
    assert not _pids(stderr)  # refused before any process started


def test_time_scale_scales_the_policy_predictions_with_the_emulators(tmp_path: Path) -> None:
    from conductor.demo.run import _scaled_params
    from predictors.params import PredictorParams
    from predictors.profile import bundled_profile, fit_profiles

    base = fit_profiles([bundled_profile()])
    scaled = PredictorParams.load(_scaled_params(0.25, tmp_path))
    assert scaled.prefill.coef == pytest.approx(tuple(c * 0.25 for c in base.prefill.coef))
    assert scaled.tbt.coef == pytest.approx(tuple(c * 0.25 for c in base.tbt.coef))


def test_a_compare_defaults_to_the_load_where_the_policies_differ() -> None:
    from conductor.demo.run import _fill_defaults, build_parser

    single = build_parser().parse_args([])
    _fill_defaults(single)
    assert (single.requests, single.length_scale) == (200, 0.125)  # the README's first run, unchanged
    compare = build_parser().parse_args(["--compare", "round_robin"])
    _fill_defaults(compare)
    assert (compare.requests, compare.length_scale) == (60, 0.25)
    given = build_parser().parse_args(["--compare", "round_robin", "--requests", "24", "--length-scale", "0.0625"])
    _fill_defaults(given)
    assert (given.requests, given.length_scale) == (24, 0.0625)
