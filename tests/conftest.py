import os

import pytest

# Tests never read a developer's CONDUCTOR_* environment. CONDUCTOR_VLLM_PYTHON is not a gateway
# setting but where the engines' interpreter is (tests/e2e_vllm/engines.py): it is kept under another
# name, which pytest-xdist's workers inherit (they start after this has run).
if "CONDUCTOR_VLLM_PYTHON" in os.environ:
    os.environ["E2E_CONDUCTOR_VLLM_PYTHON"] = os.environ["CONDUCTOR_VLLM_PYTHON"]
for _key in [k for k in os.environ if k.startswith("CONDUCTOR_")]:
    del os.environ[_key]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real-vLLM tests first: under pytest-xdist their group is then the first handed out."""
    items.sort(key=lambda item: not _engine_test(item.nodeid))  # stable: the rest keep their order


def _engine_test(nodeid: str) -> bool:
    return nodeid.startswith("tests/e2e_vllm/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`-n 2`, pyproject.toml's addopts): every test file is one unit of work,
    so its module fixtures start once, and the real-vLLM tests are one unit together, so their
    engines (a minute or more to start a pair; the mixed pair serves two modules) start once, on
    one worker, while the other worker runs the rest of the suite. (xdist's own `loadgroup` does
    not group under pytest 9.2, whose node ids it can no longer rewrite.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFileEnginesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/e2e_vllm" if _engine_test(nodeid) else nodeid.split("::", 1)[0]

    return ByFileEnginesTogether(config, log)  # type: ignore[arg-type]


# Engine start-up times (tests/e2e_vllm/engines.py TIMINGS) land in CI's log: the slow part of the
# suite, worth watching. Under pytest-xdist they are gathered on a worker and handed to the
# controller, which prints them.
_ENGINE_TIMINGS: list[str] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.e2e_vllm.engines import TIMINGS

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["vllm_engine_timings"] = list(TIMINGS)
    else:
        _ENGINE_TIMINGS.extend(TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    _ENGINE_TIMINGS.extend(getattr(node, "workeroutput", {}).get("vllm_engine_timings", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _ENGINE_TIMINGS:
        terminalreporter.write_sep("-", "real vLLM engines")
        for line in _ENGINE_TIMINGS:
            terminalreporter.write_line(line)
