"""tests/support/ci.py: a missing dependency skips locally and fails under CI=true."""

from __future__ import annotations

import pytest

from tests.support.ci import in_ci, require, require_import


@pytest.mark.parametrize("value", ["true", "1", "TRUE", "yes"])
def test_ci_values_that_mean_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci()


@pytest.mark.parametrize("value", ["", "false", "0"])
def test_ci_values_that_do_not(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    assert not in_ci()


def test_missing_dependency_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    require(True, "present")  # nothing happens
    with pytest.raises(pytest.skip.Exception, match="no frobnicator"):
        require(False, "no frobnicator")
    with pytest.raises(pytest.skip.Exception, match="no_such_module_here"):
        require_import("no_such_module_here", "the frobnicator extra")


def test_missing_dependency_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    require(1, "present")
    with pytest.raises(pytest.fail.Exception, match="CI provides this, yet it is missing: no frobnicator"):
        require(False, "no frobnicator")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_here"):
        require_import("no_such_module_here", "the frobnicator extra")
    assert require_import("json", "stdlib").dumps([]) == "[]"
