"""Fixtures shared by the real-vLLM tests: the vLLM interpreter (or a skip saying why there is none),
a session work directory and the tiny model built in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e_vllm.engines import TIMINGS, find_vllm_python, make_tiny_model


@pytest.fixture(scope="session")
def vllm_python() -> str:
    found = find_vllm_python()
    if found.path is None:
        if found.explicit:
            # CONDUCTOR_VLLM_PYTHON was set (as .ci/run does): a broken vLLM must fail, not skip
            pytest.fail(found.reason)
        pytest.skip(found.reason)
    return found.path


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, e2e_dir: Path) -> Path:
    return make_tiny_model(vllm_python, e2e_dir / "tiny-llama")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # engine start-up times land in CI's log: the slow part of these tests, worth watching
    if TIMINGS:
        terminalreporter.write_sep("-", "real vLLM engines")
        for line in TIMINGS:
            terminalreporter.write_line(line)
