"""Running the gateway: one process, or `--workers N` processes on one port that schedule as one.

One Python event loop tops out at one core; the Rust routers use them all. With `workers > 1` the
process the user started becomes a supervisor: it spawns N worker processes. Each opens its own
listening socket on the same host and port with SO_REUSEPORT, so the kernel spreads incoming
connections over them without a shared accept queue, and each runs the whole gateway (admission,
policy, relay).

What must stay one is the scheduling state. In-flight load (queued prefill work, decode streams)
goes through one shared memory segment the supervisor creates: every worker publishes its own table
into its slot every few milliseconds and reads its siblings' on each decision
(adapters/shm_load_share.py), so no instance looks idle to one worker while another fills it. The
KV index is each worker's own when `kv.index` is memory (every worker subscribes to every KV event
feed, so they agree up to the dispatch guesses of the last few milliseconds), or one shared Redis
index. With `load_share: redis` (replicas on several hosts) each worker is a replica of its own there.
What the policy's predictors learn is shared too: each worker sends the samples and ratios it
learns from its own requests' outcomes to its siblings, which learn them as their own
(predictors/lessons.py, adapters/lesson_share.py: Unix datagram sockets in a directory of mode
0700 the supervisor makes), so every worker fits its models and calibrates its admission bounds
on every outcome, not on 1/N of them.

Metrics stay per process: worker i serves /metrics, /health and /ready on `admin_port + i`, so a
scrape never mixes counters of different processes (which would make rate() nonsense). For that
reason more than one worker needs `admin_port`.

The supervisor restarts a worker that dies (its slot cleared first, so its load does not linger),
gives up when a worker fails while starting (a broken plugin or a port in use fails the same way on
every restart) or dies more than `MAX_RESTARTS` times in `RESTART_WINDOW_S`, and on SIGTERM or
SIGINT passes SIGTERM to every worker, which drains for `drain_grace_s` as a single gateway does.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING

from conductor.config.settings import Settings
from conductor.core.errors import ConfigError

if TYPE_CHECKING:
    import uvicorn

    from conductor.gateway import Gateway

log = logging.getLogger(__name__)

STARTUP_S = 10.0  # a worker that never published and exits sooner than this failed to start
WORKER_CANNOT_START = 3  # a worker's exit code: its start-up failed (a bind, a plugin), a restart fails again
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def uvicorn_config(settings: Settings, gateway: Gateway) -> uvicorn.Config:
    """The public server's configuration, the same for one process and for each of N workers."""
    import uvicorn

    from adapters.http1_server import HttpServerConnection
    from adapters.http1_server_limits import ServerLimits
    from conductor.server.app import create_app

    return uvicorn.Config(
        create_app(gateway),
        host=settings.host,
        port=settings.port,
        log_level=settings.logs.level,
        # uvicorn runs the sockets, lifespan and shutdown; each connection is the gateway's own
        # protocol (adapters/http1_server.py: one write per non-streamed answer, no watcher task)
        access_log=False,
        loop="auto",
        http=HttpServerConnection.with_limits(
            ServerLimits(
                max_connections=settings.limits.max_client_connections,
                body_timeout_s=settings.timeouts.request_body_s,
                max_pipelined=settings.limits.max_pipelined_requests,
            )
        ),
        lifespan="on",
        # nothing reads the client's address, so uvicorn's X-Forwarded-For rewriting (a middleware
        # every request passes through) is left out
        proxy_headers=False,
        log_config=None,  # uvicorn's own lines go through the handler configure_logging set (JSON or text)
        # SIGTERM: stop accepting, let requests in flight finish for timeouts.drain_grace_s, then close them
        # (typed int, used as a float timeout: fractions of a second work)
        timeout_graceful_shutdown=settings.timeouts.drain_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=settings.timeouts.keep_alive_s,  # type: ignore[arg-type]  # (a float timeout, too)
    )


def serve(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT: in this process, or through `settings.workers` worker processes."""
    from conductor.gateway import Gateway
    from conductor.server.app import run

    check_workers(settings)
    gateway = Gateway(settings)  # loads the policy: a broken plugin stops start-up here, before any fork
    if settings.workers == 1:
        run(uvicorn_config(settings, gateway), gateway)  # with admin_port set, the admin server beside it
        return 0
    return Supervisor(settings).run()


def check_workers(settings: Settings) -> None:
    """What more than one worker needs, as a clear start-up error."""
    n, admin = settings.workers, settings.admin_port
    if n == 1:
        return
    if admin is None:
        raise ConfigError(
            "workers > 1 needs admin_port: worker i serves its own /metrics on admin_port + i "
            "(counters of several processes on one port cannot be scraped consistently)"
        )
    if admin <= settings.port < admin + n:
        raise ConfigError(f"port {settings.port} collides with the workers' admin ports {admin}..{admin + n - 1}")


def check_port_free(host: str, port: int) -> None:
    """Fail when something listens on (host, port) already. The workers' SO_REUSEPORT sockets
    would otherwise join a running gateway's port silently and split its traffic; a plain bind
    (without SO_REUSEPORT) still fails there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket on (host, port) that sibling workers bind too; the kernel balances connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def worker_settings(settings: Settings, slot: int) -> Settings:
    """Worker `slot`'s settings: its own admin port and, sharing through Redis, its own replica id."""
    update: dict[str, object] = {"workers": 1}
    if settings.admin_port is not None:
        update["admin_port"] = settings.admin_port + slot
    if settings.load_share.replica_id is not None:
        update["load_share"] = settings.load_share.model_copy(update={"replica_id": f"{settings.load_share.replica_id}-w{slot}"})
    return settings.model_copy(update=update)


def run_worker(settings: Settings, slot: int, workers: int, segment: str, lessons_dir: str) -> None:
    """A worker process: the whole gateway on the shared port, its load shared through `segment`,
    what its predictors learn shared through its socket in `lessons_dir` (adapters/lesson_share.py)."""
    from adapters.lesson_share import UnixLessonShare
    from adapters.shm_load_share import SharedMemoryLoadShare
    from conductor.gateway import Gateway
    from conductor.ops.logs import configure_logging
    from conductor.server.app import run

    settings = worker_settings(settings, slot)
    configure_logging(settings.logs.level, settings.logs.format, settings.logs.access_log)
    share = SharedMemoryLoadShare(segment, slot, workers) if settings.load_share.mode == "none" else None
    lessons = UnixLessonShare(lessons_dir, slot, workers) if settings.share_lessons else None
    gateway = Gateway(settings, load_share=share, lesson_share=lessons)
    sock = listening_socket(settings.host, settings.port)
    log.info(
        "worker %d of %d (pid %d) on %s:%d, admin port %s",
        slot,
        workers,
        os.getpid(),
        settings.host,
        settings.port,
        settings.admin_port,
    )
    try:
        run(uvicorn_config(settings, gateway), gateway, sockets=[sock])
    except ConfigError as exc:  # a start-up failure of the operator's making: one line, not a traceback
        log.error("worker %d cannot start: %s", slot, exc.message)
        raise SystemExit(WORKER_CANNOT_START) from None
    except SystemExit as exc:
        # uvicorn exits only when a server could not start (its admin port taken, say); said by
        # the exit code, not by how long the worker lived, which a busy host stretches past STARTUP_S
        if exc.code not in (0, None):
            raise SystemExit(WORKER_CANNOT_START) from None
        raise


class Supervisor:
    """Starts the workers, restarts the ones that die, stops them all on a signal."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.n = settings.workers
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and sockets
        self._procs: list[BaseProcess | None] = [None] * self.n
        self._started_at = [0.0] * self.n
        self._deaths: deque[float] = deque()
        self._stopping = False
        self._lessons_dir = ""  # the workers' lesson sockets (mode 0700), made in run()

    def _start(self, slot: int, segment: str) -> None:
        proc = self._ctx.Process(
            target=run_worker, args=(self.settings, slot, self.n, segment, self._lessons_dir), name=f"conductor-worker-{slot}"
        )
        proc.start()
        self._procs[slot], self._started_at[slot] = proc, time.monotonic()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def run(self) -> int:
        from adapters.shm_load_share import clear_slot, create_segment, slot_written

        check_port_free(self.settings.host, self.settings.port)
        shm = create_segment(self.n)
        assert shm.buf is not None
        self._lessons_dir = tempfile.mkdtemp(prefix="conductor-lessons-")  # mode 0700: this user only
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            for slot in range(self.n):
                self._start(slot, shm.name)
            log.info(
                "%d workers on %s:%d (pids %s)",
                self.n,
                self.settings.host,
                self.settings.port,
                [p.pid for p in self._procs if p is not None],
            )
            while not self._stopping:
                sentinels = {p.sentinel: slot for slot, p in enumerate(self._procs) if p is not None}
                for ready in wait(list(sentinels), timeout=0.5):
                    slot = sentinels[ready]  # type: ignore[index]
                    proc = self._procs[slot]
                    assert proc is not None
                    proc.join()
                    started = slot_written(shm.buf, slot)  # its gateway came up and published
                    clear_slot(shm.buf, slot)
                    if self._stopping:
                        break
                    code = self._after_death(slot, proc.exitcode, started)
                    if code:
                        self._stopping = True
                        break
                    self._start(slot, shm.name)
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shm.close()
            shm.unlink()
            shutil.rmtree(self._lessons_dir, ignore_errors=True)
        return code

    def _after_death(self, slot: int, exitcode: int | None, started: bool) -> int:
        """0 to restart the worker; else the supervisor's exit code (it gives up). `started`: its
        gateway got through start-up (without a shared memory slot, as with Redis load sharing,
        only surviving STARTUP_S tells)."""
        now = time.monotonic()
        lived = now - self._started_at[slot]
        if exitcode == WORKER_CANNOT_START or (not started and lived < STARTUP_S):
            log.error("worker %d exited with %s %.1fs after it started: it cannot start; stopping", slot, exitcode, lived)
            return 1
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
            self._deaths.popleft()
        if len(self._deaths) > MAX_RESTARTS:
            log.error("workers died %d times in %.0fs; stopping", len(self._deaths), RESTART_WINDOW_S)
            return 1
        log.warning("worker %d exited with %s after %.0fs; restarting it", slot, exitcode, lived)
        return 0

    def _stop_all(self) -> None:
        """SIGTERM to every worker (each drains), then SIGKILL to any still there after the grace."""
        alive = [p for p in self._procs if p is not None and p.is_alive()]
        for proc in alive:
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.timeouts.drain_grace_s + 5.0
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("worker pid %s did not stop within the drain grace; killing it", proc.pid)
                proc.kill()
                proc.join()
