"""Real uvicorn servers on free loopback ports (tests/support/ports.py), each on its own thread and event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from adapters.http1_server import HttpServerConnection
from conductor.gateway import Gateway
from conductor.server.app import FastPath, create_app
from tests.support.ports import free_port as free_port
from tests.support.ports import free_port_run as free_port_run
from tests.support.waiting import wait_for


class ServerThread:
    def __init__(self, app: Any, port: int | None = None, **config: Any) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if isinstance(app, FastPath):  # the gateway serves on its own protocol and keep-alive, as in production
            config.setdefault("http", HttpServerConnection)
            config.setdefault("timeout_keep_alive", app.state.gateway.settings.timeouts.keep_alive_s)
        self.config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False, lifespan="auto", **config
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self, timeout: float = 60.0) -> ServerThread:  # a bound for a busy box, not a speed check
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serve(app: Any, port: int | None = None, **config: Any) -> Iterator[ServerThread]:
    server = ServerThread(app, port, **config).start()
    try:
        yield server
    finally:
        server.stop()


# how long a test waits for a gateway to report itself ready: a bound for a starved box
READY_TIMEOUT_S = 60.0


@contextmanager
def serve_gateway(
    gateway: Gateway, port: int | None = None, *, ready_timeout_s: float | None = READY_TIMEOUT_S, **config: Any
) -> Iterator[ServerThread]:
    """The gateway served, yielded once it reports itself ready (its instances answered a health
    probe), as a load balancer's readiness check would wait; `ready_timeout_s` None: at once.

    Without the wait a test's first request can race the first probe: on a starved machine that
    probe can time out, and until the next one answers no instance is in rotation, so the request
    gets a correct 503 the test did not mean to provoke (seen in CI)."""
    with serve(create_app(gateway), port, **config) as server:
        if ready_timeout_s is not None and not wait_for(lambda: gateway.ready()[0], ready_timeout_s):
            raise AssertionError(f"the gateway was not ready within {ready_timeout_s} s: {gateway.ready()[1]}")
        yield server
