"""Fixtures shared by the real-vLLM tests: the vLLM interpreter (or a skip saying why there is none;
a failure under CI or with CONDUCTOR_VLLM_PYTHON set), a session work directory and the tiny model
built in it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_vllm.engines import (
    HASH_SEED,
    Engine,
    MixedEngines,
    find_vllm_python,
    make_tiny_model,
    python_imports,
    start_all,
    stop_all,
)
from tests.support.ci import in_ci, require


@pytest.fixture(scope="session")
def vllm_python() -> str:
    found = find_vllm_python()
    if found.path is None:
        if found.explicit:
            # CONDUCTOR_VLLM_PYTHON was set (as .ci/run does): a broken vLLM must fail, not skip
            pytest.fail(found.reason)
        require(False, found.reason)
    assert found.path is not None  # require() raised otherwise
    return found.path


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, e2e_dir: Path) -> Path:
    return make_tiny_model(vllm_python, e2e_dir / "tiny-llama")


@pytest.fixture(scope="package")
def mixed_engines(vllm_python: str, tiny_model: Path, e2e_dir: Path) -> Iterator[MixedEngines]:
    """Two mixed engines shared by the modules that put gateways in front of them (each module
    its own gateways, each test its own prompts): an engine start costs a minute or more."""
    # xxhash (pickle + XXH3-128) when the engines' venv has it, as .ci/vllm.sh installs it; else the
    # default sha256 (the P/D module covers sha256 with vLLM's default seed). CI installs xxhash, so
    # there a fallback would quietly leave the xxhash key mode untested: it fails instead
    missing = python_imports(vllm_python, "xxhash")
    if missing is not None and in_ci():
        pytest.fail(f"xxhash does not import under {vllm_python}: {missing} (bash .ci/vllm.sh installs it)", pytrace=False)
    algo = "xxhash" if missing is None else "sha256"
    engines = {
        f"mixed-{i}": Engine(
            f"mixed-{i}", vllm_python, tiny_model, e2e_dir / "mixed", core=i, hash_algo=algo, hash_seed=HASH_SEED, kv_events=True
        )
        for i in range(2)
    }
    start_all(list(engines.values()))
    try:
        yield MixedEngines(engines, algo)
    finally:
        stop_all(engines.values())
