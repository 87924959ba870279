"""A third-party distribution registering policies in `conductor.policies`, installed for real with
pip into this environment, then loaded by name; broken plugins fail with a clear PluginError."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conductor.core.errors import PluginError
from conductor.core.types import ClusterSnapshot, InstanceView, Observation, RequestView, Role
from policies.registry import available_policies, load_policy

DIST = "conductor-demo-plugin"
SOURCE = Path(__file__).parent / "thirdparty_policy"


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    src = tmp_path_factory.mktemp("plugin") / "src"
    shutil.copytree(SOURCE, src)  # build from a copy: no build/ or egg-info litter in the repo
    run = _pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(src))
    assert run.returncode == 0, run.stderr
    importlib.invalidate_caches()
    try:
        yield
    finally:
        _pip("uninstall", "-y", DIST)
        for mod in [m for m in sys.modules if m.startswith("conductor_demo_plugin")]:
            del sys.modules[mod]
        importlib.invalidate_caches()


def test_third_party_policy_routes(installed: None) -> None:
    assert {"demo_last", "demo_broken", "demo_nodecide"} <= set(available_policies())
    pol = load_policy("demo_last", {"tag": "-x"})
    cluster = ClusterSnapshot(
        0.0,
        (
            InstanceView("p-a", Role.PREFILL),
            InstanceView("p-b", Role.PREFILL),
            InstanceView("d-a", Role.DECODE),
            InstanceView("d-c", Role.DECODE),
        ),
    )
    d = pol.decide(RequestView("r1", 1, "m", 100, 10), cluster)
    assert (d.prefill, d.decode, d.policy) == ("p-b", "d-c", "demo_last-x")
    pol.observe(Observation("r1", "p-b", "d-c", 100, 0, 0, 0.1, 0.1))
    assert getattr(pol, "observed", 0) == 1


def test_plugin_that_fails_to_import(installed: None) -> None:
    with pytest.raises(PluginError, match=r"'demo_broken'.*failed to import.*conductor_demo_plugin_missing_dependency"):
        load_policy("demo_broken")


def test_plugin_without_decide(installed: None) -> None:
    with pytest.raises(PluginError, match=r"'demo_nodecide'.*does not satisfy the Policy protocol.*decide\(\)"):
        load_policy("demo_nodecide")


def test_plugin_with_unknown_option(installed: None) -> None:
    with pytest.raises(PluginError, match=r"'demo_last'.*failed to construct.*colour"):
        load_policy("demo_last", {"colour": "red"})


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(PluginError, match=r"'nope' is not registered.*kvcache_aware"):
        load_policy("nope")
