"""The gateway keeps an idle client connection open for `timeouts.keep_alive_s`, not uvicorn's 5 s.

A client reuses an idle connection until its own expiry (httpx 5 s, aiohttp 15 s, a proxy's 60 s);
a server that closes first races it, and the request written at that moment is lost ("server
disconnected without sending a response": a CI run lost 7 of a demo's 30 requests and a /ready
probe that way). Measured here on real sockets, with responses read by h11."""

from __future__ import annotations

import socket
import time

import h11

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from conductor.server.serving import uvicorn_config
from tests.support.cluster import cluster
from tests.support.waiting import wait_for

UVICORN_DEFAULT_S = 5.0


def _get(sock: socket.socket, conn: h11.Connection, path: str) -> int:
    sock.sendall(conn.send(h11.Request(method="GET", target=path, headers=[("Host", "gw")])) or b"")
    sock.sendall(conn.send(h11.EndOfMessage()) or b"")
    status = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError(f"{path}: the gateway closed the connection without an answer")


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_the_served_config_carries_the_setting() -> None:
    settings = load_settings(environ={}, overrides={"mixed": ["http://127.0.0.1:9"], "timeouts": {"keep_alive_s": 12.5}})
    assert uvicorn_config(settings, Gateway(settings)).timeout_keep_alive == 12.5  # what `conductor serve` runs
    default = load_settings(environ={}, overrides={"mixed": ["http://127.0.0.1:9"]})
    assert default.timeouts.keep_alive_s == 75.0  # past aiohttp's 15 s and a proxy's 60 s


def test_an_idle_connection_outlives_uvicorns_default_and_serves_the_next_request() -> None:
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, health={"interval_s": 0.2}) as c:
        host, port = c.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            conn = h11.Connection(h11.CLIENT)
            assert _get(sock, conn, "/health") == 200
            time.sleep(UVICORN_DEFAULT_S + 1.0)  # idle past the 5 s after which uvicorn would close it
            assert _get(sock, conn, "/health") == 200  # same connection


def test_a_short_setting_closes_an_idle_connection() -> None:
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, timeouts={"keep_alive_s": 0.3}) as c:
        host, port = c.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=1) as sock:
            assert _get(sock, h11.Connection(h11.CLIENT), "/health") == 200
            assert wait_for(lambda: _closed_by_peer(sock), 30.0)
