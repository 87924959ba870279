"""The house style, checked: one formatter, a clean linter and type checker, and short functions in
modules of a readable size (docs/architecture.md). Each check names what breaks it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("conductor", "policies", "predictors", "adapters", "traces")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400


def _tool(name: str) -> str:
    """The linter or type checker of this interpreter's environment (the test extra installs both)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found is not None, f"{name} is not installed: pip install -e '.[test]'"
    return found


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_lints_clean() -> None:
    done = _run(_tool("ruff"), "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_one_formatter() -> None:
    done = _run(_tool("ruff"), "format", "--check", "--no-cache", ".")
    assert done.returncode == 0, "run `ruff format .`:\n" + done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_is_clean() -> None:
    done = _run(_tool("mypy"), "--no-incremental", "--cache-dir", "/dev/null")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def long_code(root: Path) -> list[str]:
    """Functions over MAX_FUNCTION_LINES and modules over MAX_MODULE_LINES lines, as `path:line what`."""
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(root)
            if text.count("\n") > MAX_MODULE_LINES:
                found.append(f"{rel}: module of {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text, filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{rel}:{node.lineno} {node.name} is {length} lines")
    return found


def test_functions_and_modules_stay_short() -> None:
    found = long_code(ROOT)
    assert not found, "\n".join(found)


def test_a_long_function_is_caught(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "policies/p.py").write_text(f"def decide():\n{body}")
    assert long_code(tmp_path) == [f"policies/p.py:1 decide is {MAX_FUNCTION_LINES + 1} lines"]


@pytest.mark.parametrize("lines", [MAX_MODULE_LINES, MAX_MODULE_LINES + 1])
def test_a_long_module_is_caught(tmp_path: Path, lines: int) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "adapters/a.py").write_text("x = 1\n" * lines)
    assert bool(long_code(tmp_path)) is (lines > MAX_MODULE_LINES)
