"""benchmarks/bench_simulator.py: with no arguments it runs every section (it used to exit 2 on
Python 3.11, whose argparse checked the list default against the choices)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.support.benchmarks import load_benchmark


def _bench() -> ModuleType:
    return load_benchmark("bench_simulator")


def test_no_arguments_means_every_section() -> None:
    bench = _bench()
    assert bench.parse_sections([]) == list(bench.SECTIONS)
    assert bench.parse_sections(["fig5", "speed"]) == ["fig5", "speed"]


def test_an_unknown_section_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _bench().parse_sections(["fig6"])
    assert exc.value.code == 2 and "fig6" in capsys.readouterr().err
