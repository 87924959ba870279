"""A minimal PEP 517 build backend: a pure-Python wheel from pyproject.toml, stdlib only."""

from __future__ import annotations

import base64
import hashlib
import tomllib
import zipfile
from pathlib import Path
from typing import Any


def _meta() -> dict[str, Any]:
    return tomllib.loads(Path("pyproject.toml").read_text())["project"]


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(wheel_directory: str, config_settings: Any = None, metadata_directory: Any = None) -> str:
    project = _meta()
    name, version = project["name"], project["version"]
    stem = f"{name.replace('-', '_')}-{version}"
    dist_info = f"{stem}.dist-info"
    files: dict[str, bytes] = {}
    for pkg in Path(".").glob("*/__init__.py"):
        for path in sorted(pkg.parent.rglob("*.py")):
            files[path.as_posix()] = path.read_bytes()
    files[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: demo_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    groups = project.get("entry-points", {})
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in groups.items()]
    files[f"{dist_info}/entry_points.txt"] = "\n".join(lines).encode()
    record = [_record_line(p, d) for p, d in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel_name = f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(Path(wheel_directory) / wheel_name, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel_name
