"""`conductor serve --workers N`: the start-up errors, each a clean exit with a message. Apart from
test_serving.py so that `-n 2 --dist loadfile` can run them beside its slow multi-worker tests."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from tests.support.serve_cli import serve_command as _command
from tests.support.serve_cli import serve_env as _env
from tests.support.servers import free_port

pytestmark = pytest.mark.timeout(400)  # the bounds below, on a box busy with vLLM engine start-ups


def test_more_than_one_worker_needs_an_admin_port() -> None:
    out = subprocess.run(
        _command(free_port(), None, 2, "--mixed", "http://127.0.0.1:9"), env=_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2
    assert "needs admin_port" in out.stderr


def test_a_port_in_use_is_a_clean_error_not_a_shared_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            _command(port, free_port(), 2, "--mixed", "http://127.0.0.1:9"),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr


def test_a_worker_that_cannot_start_stops_the_supervisor() -> None:
    port = free_port()
    with socket.socket() as taken:  # worker 1's admin port is taken: it fails the same way every time
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        admin = taken.getsockname()[1] - 1
        out = subprocess.run(
            _command(port, admin, 2, "--mixed", "http://127.0.0.1:9"), env=_env(), capture_output=True, text=True, timeout=300
        )
    assert out.returncode == 1
    assert "cannot start" in out.stdout + out.stderr


def test_a_slow_start_up_failure_still_stops_the_supervisor() -> None:
    """A worker whose start-up failed says so by its exit code: on a busy host it may have lived past
    STARTUP_S (CI: six restarts of a worker whose admin port was taken, read as deaths of a running one)."""
    from conductor.config.settings import Settings
    from conductor.server.serving import STARTUP_S, WORKER_CANNOT_START, Supervisor

    supervisor = Supervisor(Settings(workers=2, admin_port=free_port()))
    supervisor._started_at[1] = time.monotonic() - 3 * STARTUP_S  # it took long to fail
    assert supervisor._after_death(1, WORKER_CANNOT_START, started=False) == 1
    assert supervisor._after_death(1, 1, started=True) == 0  # a running worker's death: restarted
