"""Rendering the chart with a real helm, and picking rendered manifests apart (for tests/helm)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "conductor"
NAMESPACE = "llm"
FULL = "rel-conductor"


def _helm() -> str | None:
    local = ROOT / ".ci" / "bin" / "helm"
    return shutil.which("helm") or (str(local) if os.access(local, os.X_OK) else None)


HELM = _helm()
# a fixture, not a skipif mark: a missing helm skips the test here and fails it in CI (tests/helm/conftest.py)
needs_helm = pytest.mark.usefixtures("helm_required")


def helm(*args: str) -> str:
    assert HELM is not None
    done = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


# the pre-discovery instance list rendered from the replica counts: for the tests that check it, or that
# run the rendered gateway here, where the Services' DNS names do not resolve
STATIC = "gateway.discovery.enabled=false"


def render(*sets: str) -> list[dict[str, Any]]:
    flags = [f for s in sets for f in ("--set", s)]
    out = helm("template", "rel", str(CHART), "--namespace", NAMESPACE, *flags)
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = doc["spec"]["template"]["spec"]["containers"][0]
    return c


def ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def gateway_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])
    return cfg


def venv_exe(name: str) -> str | None:
    """A console script of this project's virtualenv (or PATH)."""
    return shutil.which(name, path=str(ROOT / ".venv" / "bin") + os.pathsep + os.environ.get("PATH", ""))


def _log_tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""


def wait_http(
    url: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0, status: int = 200, log: Path | None = None
) -> httpx.Response:
    """Poll url until it answers `status`; fail at once if the process exits. A failure says what
    the url last answered and, given the process's log file, how that log ends."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited with {proc.returncode}\n{_log_tail(log)}")
        try:
            r = httpx.get(url, timeout=1)
            if r.status_code == status:
                return r
            last = f"{r.status_code} {r.text[:500]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        if time.monotonic() >= deadline:
            raise AssertionError(f"{url} did not answer {status} within {timeout_s} s; last: {last}\n{_log_tail(log)}")
        time.sleep(0.1)
