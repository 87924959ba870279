"""The `conductor serve --workers N` command line the serving tests start, and its environment."""

from __future__ import annotations

import sys


def serve_command(port: int, admin: int | None, workers: int, *instances: str, policy: str = "least_loaded") -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "conductor",
        "serve",
        "--workers",
        str(workers),
        "--port",
        str(port),
        "--model",
        "tiny",
        "--policy",
        policy,
        "--log-level",
        "warning",
        *instances,
    ]
    return cmd + (["--admin-port", str(admin)] if admin is not None else [])


def serve_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "CONDUCTOR_TIMEOUTS__DRAIN_GRACE_S": "5", "CONDUCTOR_HEALTH__INTERVAL_S": "0.5"}
