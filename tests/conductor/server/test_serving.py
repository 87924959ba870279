"""`conductor serve --workers N`: real worker processes on one port, sharing their load through
shared memory, restarted when they die, drained on SIGTERM (the start-up errors: test_serving_startup.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.serve_cli import serve_command as _command
from tests.support.serve_cli import serve_env as _env
from tests.support.servers import free_port, free_port_run, serve
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

# a bound on waiting for the workers to come up, not a check of their speed: under `-n 2` they may
# start while the other test worker's vLLM engines start on both cores (a CI run saw 60 s pass)
STARTUP_S = 150
pytestmark = pytest.mark.timeout(400)  # the suite's 120 s would cut the bound above short


@contextmanager
def supervisor(cmd: list[str], tmpdir: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """`tmpdir`: the supervisor's TMPDIR (where it makes its lessons directory), so a test counts its own."""
    env = _env() if tmpdir is None else {**_env(), "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _output(proc: subprocess.Popen[str]) -> str:
    """What a supervisor that stopped printed (for an assertion message)."""
    if proc.poll() is None or proc.stdout is None:
        return "still running, not ready"
    return proc.stdout.read()[-3000:]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:  # a thread that ended meanwhile
            continue
    return found


def _worker_pids(pid: int) -> set[int]:
    """The supervisor's worker processes (spawned: not its resource tracker)."""
    return {c for c in _children(pid) if b"spawn_main" in _cmdline(c)}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def _served(admin_url: str) -> float:
    text = httpx.get(admin_url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("conductor_requests_total{") and 'status="200"' in line
    )


def test_two_workers_share_the_port_and_see_each_others_streams() -> None:
    with ExitStack() as stack:
        prefill = StandIn(role="prefill")
        decodes = [StandIn(role="decode", token_delay_s=0.1) for _ in range(2)]
        p_url = stack.enter_context(serve(prefill)).url
        d_args = [a for d in decodes for a in ("--decode", stack.enter_context(serve(d)).url)]
        port, admin = free_port(), free_port_run(2)
        while admin <= port <= admin + 1:
            admin = free_port_run(2)
        proc = stack.enter_context(supervisor(_command(port, admin, 2, "--prefill", p_url, *d_args)))
        url, admins = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{admin + i}" for i in range(2)]
        assert wait_for(lambda: all(_ready(a) for a in admins), timeout=STARTUP_S), _output(proc)

        # one long stream occupies decode-0 (least_loaded breaks the tie of an idle cluster by order)
        def stream() -> None:
            with contextlib.suppress(httpx.HTTPError):  # cut short by the shutdown at the end
                httpx.post(
                    url + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": "x", "max_tokens": 600, "stream": True}
                )

        threading.Thread(target=stream, daemon=True).start()
        assert wait_for(lambda: len(decodes[0].requests) == 1, timeout=30)
        # pacing only (the siblings' tables are republished every 5 ms): generous, as a loaded box may
        # leave a worker's loop unscheduled for a while
        threading.Event().wait(2.0)
        # short requests on new connections, so the kernel hands them to both workers: the worker
        # that did not dispatch the stream sees decode-0 busy only through the shared memory (alone,
        # it would break the tie towards decode-0 again)
        for _ in range(16):
            r = httpx.post(url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "y", "max_tokens": 1})
            assert r.status_code == 200
        assert len(decodes[0].requests) == 1
        assert len(decodes[1].requests) == 16
        assert all(_served(a) > 0 for a in admins)  # both workers served some
        assert sum(_served(a) for a in admins) == 16


def _lessons(admin_url: str) -> dict[str, float]:
    text = httpx.get(admin_url + "/metrics", timeout=5).text
    prefix = 'conductor_worker_lessons_total{event="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def test_two_workers_learn_from_each_others_outcomes() -> None:
    with ExitStack() as stack:
        p_url = stack.enter_context(serve(StandIn(role="prefill"))).url
        d_url = stack.enter_context(serve(StandIn(role="decode"))).url
        port, admin = free_port(), free_port_run(2)
        while admin <= port <= admin + 1:
            admin = free_port_run(2)
        proc = stack.enter_context(
            supervisor(_command(port, admin, 2, "--prefill", p_url, "--decode", d_url, policy="kvcache_aware"))
        )
        admins = [f"http://127.0.0.1:{admin + i}" for i in range(2)]
        assert wait_for(lambda: all(_ready(a) for a in admins), timeout=STARTUP_S), _output(proc)
        for i in range(40):  # new connections: the kernel hands them to both workers
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=30,
                json={"model": "tiny", "prompt": f"prompt {i} " * 20, "max_tokens": 2},
            )
            assert r.status_code == 200
        assert all(_served(a) > 0 for a in admins)

        # every lesson one worker learned from its own outcomes, the other learned too
        def all_learned() -> bool:
            w0, w1 = (_lessons(a) for a in admins)
            return w0["received"] == w1["sent"] and w1["received"] == w0["sent"]

        assert wait_for(all_learned, timeout=30)
        counts = [_lessons(a) for a in admins]
        assert all(c["sent"] > 0 for c in counts)  # each dispatched some, and learned from them
        assert all(c["refused"] == 0 and c["dropped"] == 0 for c in counts)


def _mapped_segments(pid: int) -> set[str]:
    """The shared memory segments (multiprocessing.shared_memory's psm_*) a process has mapped."""
    return {line.rsplit("/", 1)[1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/psm_" in line}


def _lesson_dirs(tmpdir: Path) -> set[str]:
    return {n for n in os.listdir(tmpdir) if n.startswith("conductor-lessons-")}


def test_a_killed_worker_is_replaced_and_sigterm_stops_all_and_frees_the_segment(tmp_path: Path) -> None:
    # this supervisor's own TMPDIR: the other tests' supervisors (this file's, test_serve_defaults')
    # make lessons directories of their own meanwhile
    with ExitStack() as stack:
        mixed_url = stack.enter_context(serve(StandIn())).url
        port, admin = free_port(), free_port_run(2)
        while admin <= port <= admin + 1:
            admin = free_port_run(2)
        proc = stack.enter_context(supervisor(_command(port, admin, 2, "--mixed", mixed_url), tmp_path))
        admins = [f"http://127.0.0.1:{admin + i}" for i in range(2)]
        assert wait_for(lambda: all(_ready(a) for a in admins), timeout=STARTUP_S), _output(proc)
        workers = _worker_pids(proc.pid)
        assert len(workers) == 2
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        assert wait_for(lambda: len(_worker_pids(proc.pid) - workers) == 1, timeout=60)
        assert wait_for(lambda: all(_ready(a) for a in admins), timeout=STARTUP_S)
        assert victim not in _worker_pids(proc.pid)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", timeout=30, json={"model": "tiny", "prompt": "z", "max_tokens": 1}
        )
        assert r.status_code == 200
        survivors = _worker_pids(proc.pid)
        # this supervisor's own segment (others' tests may make segments of their own meanwhile)
        segments = set().union(*(_mapped_segments(pid) for pid in survivors))
        assert len(segments) == 1 and len(_lesson_dirs(tmp_path)) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert all(not Path(f"/proc/{pid}").exists() for pid in survivors)
    assert not segments & set(os.listdir("/dev/shm"))
    assert not _lesson_dirs(tmp_path)
