"""Policies and predictors stay pure: importing all of them pulls in no HTTP, Redis, zmq or asyncio,
so the gateway and the trace simulator can run the very same objects."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "predictors",
    "predictors.cli",
    "policies.base",
    "policies.estimate",
    "policies.admission",
    "policies.kvcache_aware",
    "policies.simple",
    "policies.sglang_cache_aware",
    "policies.dynamo_kv",
    "policies.llmd",
]
FORBIDDEN = ["asyncio", "httpx", "aiohttp", "redis", "zmq", "fastapi", "uvicorn", "starlette", "requests"]


def test_no_io_libraries_imported() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}: importlib.import_module(m)\n"
        f"print(sorted(set({FORBIDDEN!r}) & set(sys.modules)))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
