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

Inside the gateway, its rooms (conductor/<room>/) keep arrows of their own (ROOM_ARROWS): the request-level
rooms (server, routing, kv, fleet) and everything below them never import the wiring (conductor.gateway),
which only the app factory and the serving loop build. And no import circle: module-level imports
(those under `if TYPE_CHECKING:` too) form no cycle anywhere in the five packages.
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

# conductor/<room>/ -> the rooms it may import (besides itself and core). "gateway" is conductor/gateway.py,
# the wiring; "cli" is conductor/cli.py; "top" is conductor/__init__ and __main__.
_BELOW_SERVER = frozenset({"config", "ops", "kv", "fleet", "routing"})
ROOM_ARROWS: dict[str, frozenset[str]] = {
    "config": frozenset(),
    "ops": frozenset({"config"}),
    "kv": frozenset({"config", "ops"}),
    "fleet": frozenset({"config", "ops", "kv"}),
    "routing": frozenset({"config", "ops", "kv", "fleet"}),
    "server": _BELOW_SERVER,
    "gateway": _BELOW_SERVER | {"server"},  # the wiring builds the request path the server calls
    "indexer": frozenset({"config", "ops", "kv", "server", "cli"}),
    "demo": frozenset({"config", "ops", "server", "cli"}),
    "cli": frozenset({"config", "ops", "server", "top"}),
    "top": frozenset({"cli"}),
}
# the app factory and the serving loop build the wiring around the HTTP surface
ROOM_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset(
    {("conductor.server.app", "gateway"), ("conductor.server.serving", "gateway")}
)
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


def room_of(module: str) -> str | None:
    """conductor.<room>.x -> room; conductor.gateway / conductor.cli -> gateway / cli; None outside conductor/."""
    parts = module.split(".")
    if parts[0] != "conductor" or (len(parts) > 1 and parts[1] == "core"):
        return None
    if len(parts) == 1 or parts[1] in ("__main__", "__version__"):
        return "top"
    return parts[1]


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
                found.extend(_room_violation(module, name, line))
                if target is None or target in ALLOWED[source]:
                    continue
                if any(module == m and (name == t or name.startswith(t + ".")) for m, t in EXCEPTIONS):
                    continue
                found.append(Violation(module, name, line, f"{source} may not import {target}"))
    return found


def _room_violation(module: str, name: str, line: int) -> list[Violation]:
    source, target = room_of(module), room_of(name)
    if source is None or target is None or target == source or (module, target) in ROOM_EXCEPTIONS:
        return []
    if target in ROOM_ARROWS.get(source, frozenset()):
        return []
    return [Violation(module, name, line, f"room {source} may not import room {target}")]


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each project module -> the project modules its module-level imports load (TYPE_CHECKING ones too)."""
    paths = {module_name(p, root): p for package in PACKAGES for p in (root / package).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = [n for n in _module_level(tree.body)]
        deps = set()
        for name, _ in imported_names(ast.Module(body=top_level, type_ignores=[]), module, path.name == "__init__.py"):
            target = resolve(name)
            # a module importing its own package (__init__) is how Python loads it, not a circle
            if target and target != module and not module.startswith(target + "."):
                deps.add(target)
        graph[module] = deps
    return graph


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Import statements run when the module loads: top level, and inside module-level if/try blocks."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If):
            out.extend(_module_level(node.body) + _module_level(node.orelse))
        elif isinstance(node, ast.Try):
            out.extend(_module_level(node.body))
    return out


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle() -> None:
    circles = import_circles(module_graph(ROOT))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_a_circle_is_caught(tmp_path: Path) -> None:
    tree = _tree(
        tmp_path,
        {
            "adapters/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adapters.b import B\n",
            "adapters/b.py": "from adapters import a\n",
            "adapters/c.py": "def f():\n    from adapters import a\n",  # inside a function: loaded late, no circle
        },
    )
    assert import_circles(module_graph(tree)) == [["adapters.a", "adapters.b"]]


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
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
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
        ("conductor/routing/relay.py", "from conductor.gateway import Gateway\n", "room routing may not import room gateway"),
        ("conductor/server/endpoint.py", "from conductor import gateway\n", "room server may not import room gateway"),
        ("conductor/kv/analyzer.py", "from conductor.routing.relay import x\n", "room kv may not import room routing"),
        ("conductor/config/settings.py", "from conductor.kv.analyzer import K\n", "room config may not import room kv"),
        ("conductor/fleet/membership.py", "from conductor.server.app import x\n", "room fleet may not import room server"),
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
        "conductor/server/app.py": "import adapters.pd\nimport traces.live\n",
        "conductor/core/t.py": "from . import errors\nimport numpy\n",
        "conductor/core/u.py": "from conductor import core\n",
        "conductor/gateway.py": "from conductor.routing.relay import x\nfrom conductor.fleet import instances\n",
        "conductor/routing/relay.py": "from conductor.kv.analysis import A\nfrom conductor.core.types import T\n",
    }
    assert violations(_tree(tmp_path, files)) == []
