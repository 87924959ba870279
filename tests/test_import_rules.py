"""The house as drawn in docs/architecture.md: which package may import which.

Every module of the five packages is parsed (ast, so imports inside functions count too) and each
import of another part of the project is checked against the allowed arrows:

    gateway (conductor.*)  -> everything
    traces                 -> policies, predictors, core   (live replay may use adapters' HTTP client)
    policies               -> predictors, core
    predictors             -> core
    adapters               -> core
    core (conductor.core)  -> nothing of the project

and the pure layers (core, policies, predictors) import no network, event-loop or server library.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("conductor", "policies", "predictors", "adapters", "traces")

ALLOWED: dict[str, frozenset[str]] = {
    "gateway": frozenset({"gateway", "core", "policies", "predictors", "adapters", "traces"}),
    "traces": frozenset({"traces", "core", "policies", "predictors"}),
    "policies": frozenset({"policies", "core", "predictors"}),
    "predictors": frozenset({"predictors", "core"}),
    "adapters": frozenset({"adapters", "core"}),
    "core": frozenset({"core"}),
}
# live replay drives a running gateway over HTTP: it may use the adapters' upstream client, nothing else
EXCEPTIONS: frozenset[tuple[str, str]] = frozenset({("traces.live", "adapters.http1"), ("traces.live_client", "adapters.http1")})
PURE_LAYERS = frozenset({"core", "policies", "predictors"})
IO_LIBRARIES = frozenset(
    {
        "asyncio",
        "socket",
        "selectors",
        "ssl",
        "subprocess",
        "httpx",
        "aiohttp",
        "httptools",
        "h11",
        "redis",
        "zmq",
        "fastapi",
        "starlette",
        "uvicorn",
        "requests",
        "urllib",
        "http",
        "uvloop",
        "msgspec",
    }
)


@dataclass(frozen=True)
class Violation:
    module: str
    imported: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported} ({self.why})"


def layer_of(module: str) -> str | None:
    top = module.split(".")[0]
    if top not in PACKAGES:
        return None
    if top == "conductor":
        return "core" if module == "conductor.core" or module.startswith("conductor.core.") else "gateway"
    return top


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Absolute names of every import in a module (relative imports resolved)."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            # each imported name under its module: `from conductor import core` is conductor.core
            out.extend((f"{name}.{alias.name}", node.lineno) for alias in node.names)
    return out


def violations(root: Path) -> list[Violation]:
    found: list[Violation] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            source = layer_of(module)
            assert source is not None
            tree = ast.parse(path.read_text(), filename=str(path))
            for name, line in imported_names(tree, module, path.name == "__init__.py"):
                target = layer_of(name)
                top = name.split(".")[0]
                if source in PURE_LAYERS and top in IO_LIBRARIES:
                    found.append(Violation(module, name, line, f"{source} does no I/O"))
                if target is None or target in ALLOWED[source]:
                    continue
                if any(module == m and (name == t or name.startswith(t + ".")) for m, t in EXCEPTIONS):
                    continue
                found.append(Violation(module, name, line, f"{source} may not import {target}"))
    return found


def test_the_house_keeps_its_arrows() -> None:
    found = violations(ROOT)
    assert not found, "forbidden imports:\n" + "\n".join(map(str, found))


def test_conductor_package_init_imports_nothing() -> None:
    for init in (ROOT / "conductor/__init__.py", ROOT / "conductor/core/__init__.py"):
        tree = ast.parse(init.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)], init


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "conductor/core").mkdir()
    (tmp_path / "conductor/core/__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("rel", "text", "why"),
    [
        ("adapters/store.py", "from policies.types import Decision\n", "adapters may not import policies"),
        (
            "adapters/store.py",
            "def f():\n    from conductor.config.settings import Settings\n",
            "adapters may not import gateway",
        ),
        ("predictors/fit.py", "from policies import base\n", "predictors may not import policies"),
        ("policies/p.py", "import conductor.gateway\n", "policies may not import gateway"),
        ("policies/p.py", "import redis\n", "policies does no I/O"),
        ("conductor/core/t.py", "from adapters.emulator import profile\n", "core may not import adapters"),
        ("conductor/core/t.py", "from .. import gateway\n", "core may not import gateway"),
        ("traces/sim.py", "from adapters.emulator.profile import Profile\n", "traces may not import adapters"),
        ("traces/sim.py", "from conductor.errors import BadRequest\n", "traces may not import gateway"),
    ],
)
def test_a_forbidden_import_is_caught(tmp_path: Path, rel: str, text: str, why: str) -> None:
    found = violations(_tree(tmp_path, {rel: text}))
    assert [v.why for v in found] == [why]


def test_allowed_imports_pass(tmp_path: Path) -> None:
    files = {
        "adapters/store.py": "from conductor.core.types import Role\n",
        "policies/p.py": "from predictors.online import Predictors\nfrom conductor.core import errors\n",
        "traces/live.py": "from adapters.http1 import Client\n",
        "conductor/app.py": "import adapters.pd\nimport traces.live\n",
        "conductor/core/t.py": "from . import errors\nimport numpy\n",
        "conductor/core/u.py": "from conductor import core\n",
    }
    assert violations(_tree(tmp_path, files)) == []
