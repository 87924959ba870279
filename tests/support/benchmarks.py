"""Load a script under benchmarks/ as a module (they are scripts, not a package), for the tests
of their argument handling and tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/`name`.py, executed afresh as a module called `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
