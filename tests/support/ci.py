"""What CI provides must be there: a missing dependency skips a test on a developer's machine, but
fails it in CI, where a skip would let the suite pass without proving what the test is for.

CI is recognised by the environment variable CI (`.ci/run` exports CI=true, as most CI services
do). `require(...)` is for what CI installs (helm, redis-server, dnsmasq, mooncake_master, the
real-vLLM venv and its connectors); what no CI here provides (a sandbox needing root, IPv6
loopback) keeps a plain skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

_TRUE = {"1", "true", "yes", "on"}


def in_ci() -> bool:
    """Whether this run is CI's: CI set to a true value."""
    return os.environ.get("CI", "").strip().lower() in _TRUE


def require(condition: object, reason: str) -> None:
    """Nothing when `condition` holds; otherwise skip the test with `reason`, or fail it under CI."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI provides this, yet it is missing: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)  # also from a module's top, like pytest.importorskip


def require_import(module: str, reason: str) -> ModuleType:
    """The imported module; when it does not import, `require` fails or skips, saying why."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        require(False, f"{reason} (import {module}: {exc})")
        raise  # unreachable: require() raised; keeps the type checker's flow honest
