"""benchmarks/sim_ratios.py, the simulator's ratio table over seeds (bench_simulator.py ratios): the
median and range over the seeds, the best baseline picked per seed by goodput, '+local' kept out of
the headline ratio, the staged pulls by default, and the markdown the docs paste."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import pytest

from benchmarks import sim_ratios
from benchmarks.sim_ratios import RATIO_BASELINES, Cell, SeedRuns, Spread, goal_lines, local_rows, main_rows
from tests.support.benchmarks import load_benchmark
from traces.sim.results import Dist, RunResult
from traces.sim.runner import SimJob


def _run(policy: str, goodput: float, *, met: float = 0.8, local_prefills: float = 0.0) -> RunResult:
    return RunResult(
        policy=policy,
        mode="simulate",
        n_prefill=8,
        n_decode=8,
        requests=100,
        completed=100,
        rejected=0,
        rejections={},
        ttft=Dist.of([1.0]),
        tbt=Dist.of([0.03]),
        slo_ttft_s=10.0,
        slo_tbt_s=0.1,
        slo_met=round(met * 100),
        slo_attainment=met,
        goodput_rps=goodput,
        duration_s=10.0,
        makespan_s=10.0,
        prefix_hit_local=0.5,
        extra={"local_prefills": local_prefills, "prefill_s_per_served": 1.0, "served_prompt_mean": 1e4, "prefill_busy": 0.9},
    )


def _seed(seed: int, baselines: dict[str, float], ours: float, alg1: float, local: float) -> SeedRuns:
    return SeedRuns(
        seed,
        tuple(_run(name, goodput) for name, goodput in baselines.items()),
        _run("kvcache_aware", ours),
        _run("algorithm1", alg1),
        _run("local", local, local_prefills=7),
    )


def test_a_spread_is_the_median_and_the_range_in_any_order() -> None:
    assert Spread.of([1.3, 1.0, 1.2, 1.1]) == Spread(pytest.approx(1.15), 1.0, 1.3)  # even count: middle two
    assert Spread.of([2.0, 0.5, 1.0]) == Spread(1.0, 0.5, 2.0)
    assert Spread.of([1.25]).text() == "1.25 (1.25..1.25)"
    assert Spread(1.125, 1.0, 1.5).text() == "1.12 (1.00..1.50)"
    with pytest.raises(ValueError):
        Spread.of([])


def test_the_best_baseline_is_picked_per_seed_by_goodput_and_each_ratio_is_against_its_own_seed() -> None:
    # seed 0: round_robin best (10); seed 1: llmd best (8), although round_robin is higher in seed 0
    seeds = (
        _seed(0, {"round_robin": 10.0, "llmd": 9.0}, ours=12.0, alg1=10.0, local=13.0),
        _seed(1, {"round_robin": 6.0, "llmd": 8.0}, ours=8.8, alg1=8.0, local=10.0),
        _seed(2, {"round_robin": 5.0, "llmd": 4.0}, ours=5.5, alg1=4.5, local=5.0),
        _seed(3, {"round_robin": 7.0, "llmd": 7.5}, ours=9.0, alg1=7.5, local=9.0),
    )
    cell = Cell("conversation", 2.5, seeds)
    assert [s.best.policy for s in seeds] == ["round_robin", "llmd", "round_robin", "llmd"]
    assert cell.winners == {"round_robin": 2, "llmd": 2}
    assert cell.per_seed("ours") == pytest.approx([1.2, 1.1, 1.1, 1.2])
    assert cell.ratio("ours") == Spread(pytest.approx(1.15), pytest.approx(1.1), pytest.approx(1.2))
    assert cell.ratio("alg1") == Spread(pytest.approx(1.0), pytest.approx(0.9), pytest.approx(1.0))
    assert cell.ratio("local") == Spread(pytest.approx(1.225), pytest.approx(1.0), pytest.approx(1.3))
    assert cell.best_goodput == Spread(7.75, 5.0, 10.0)  # the best of each seed: 10, 8, 5, 7.5


def test_goodput_picks_the_best_baseline_not_slo_attainment_and_a_tie_goes_to_the_first_listed() -> None:
    runs = SeedRuns(0, (_run("a", 5.0, met=0.99), _run("b", 6.0, met=0.5), _run("c", 6.0)), *(_run("x", 1.0),) * 3)
    assert runs.best.policy == "b"


def test_plus_local_stays_out_of_the_headline_table_and_has_its_own() -> None:
    seeds = tuple(_seed(i, {"round_robin": 10.0}, ours=11.0, alg1=10.0, local=15.0 + i) for i in range(4))
    cell = Cell("tool-agent", 4.0, seeds, reusable=0.91)
    (main,) = main_rows([cell])
    assert main[2] == "round_robin 4" and main[6] == "1.10 (1.10..1.10)" and main[-1] == "91%"
    assert not any("1.5" in x or "1.6" in x for x in main)  # no '+local' figure in the headline row
    (local,) = local_rows([cell])
    assert local[4] == "1.65 (1.50..1.80)" and local[5] == "1.10" and local[-1] == "7"


def test_the_goal_is_judged_on_the_medians_and_on_every_seed() -> None:
    def cell(trace: str, speedup: float, ours: Sequence[float]) -> Cell:
        return Cell(trace, speedup, tuple(_seed(i, {"rr": 1.0}, o, 1.0, o) for i, o in enumerate(ours)))

    cells = [
        cell("a", 1, [1.2, 1.2, 1.1]),  # median 1.2, one seed 1.1
        cell("a", 2, [1.3, 1.2, 1.2]),
        cell("b", 1, [1.2, 1.2, 1.2]),
        cell("b", 2, [1.2, 1.2, 1.2]),
        cell("c", 1, [0.9, 1.0, 1.0]),
        cell("c", 2, [1.0, 1.0, 1.0]),
    ]
    median, every = goal_lines(cells)[:2]
    assert "2 of 3 reach it (a, b), lowest 1.00x" in median
    assert "1 of 3 reach it (b), lowest 0.90x" in every


def _bench() -> ModuleType:
    return load_benchmark("bench_simulator")


def _fake_runs(jobs: Sequence[SimJob], **_: object) -> list[RunResult]:
    """Goodput from the seed and the policy: kvcache_aware 1.2x the best baseline, llmd best."""
    rates = {"llmd": 10.0, "kvcache_aware": 12.0, "algorithm1": 10.5, "local": 13.0}
    return [_run(j.spec.label or j.spec.name, rates.get(j.spec.label or j.spec.name, 5.0) + j.config.seed) for j in jobs]


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[SimJob]:
    """The simulator faked out: the jobs the command ran, answered by `_fake_runs`."""
    ran: list[SimJob] = []
    monkeypatch.setattr(sim_ratios, "run_jobs", lambda js: ran.extend(js) or _fake_runs(js))
    monkeypatch.setattr(sim_ratios, "load_requests", lambda trace, limit=None: ())
    monkeypatch.setattr(sim_ratios, "reusable_prefix_share", lambda reqs: 0.5)
    return ran


def test_ratios_runs_four_seeds_of_staged_pulls_by_default_and_prints_markdown(
    jobs: list[SimJob], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bench().main(["ratios", "--markdown"]) == 0
    assert {j.config.seed for j in jobs} == {0, 1, 2, 3} and {j.config.pull for j in jobs} == {"staged"}
    assert len(jobs) == 3 * 2 * 4 * (len(RATIO_BASELINES) + 3)
    out = capsys.readouterr().out
    assert "| workload | speed-up | best baseline (seeds won) |" in out
    assert "| conversation | 2.5x | llmd 4 |" in out
    # seed s: kvcache_aware (12 + s) / llmd (10 + s): 1.2, 1.18, 1.17, 1.15 -> median 1.17
    assert "1.17 (1.15..1.20)" in out and "DIRECT-READ" not in out


def test_the_direct_read_variant_is_its_own_labelled_section(jobs: list[SimJob], capsys: pytest.CaptureFixture[str]) -> None:
    _bench().main(["ratios-direct", "--seeds", "2"])
    assert {j.config.pull for j in jobs} == {"both"} and {j.config.seed for j in jobs} == {0, 1}
    assert "DIRECT-READ variant" in capsys.readouterr().out


def test_fewer_than_one_seed_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        _bench().parse_options(["ratios", "--seeds", "0"])
