"""Streams flow byte for byte as they arrive, with no Nagle/delayed-ACK stall, over pooled
connections; a client that leaves mid-stream cancels every upstream leg."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.support.cluster import cluster
from tests.support.waiting import wait_for


def test_no_stall_on_kept_alive_stream_at_concurrency_1() -> None:
    # 40 tokens 2 ms apart: a Nagle/delayed-ACK stall adds ~40 ms per write and would show at once.
    with cluster("nixl", standin={"decode": {"token_delay_s": 0.002}}) as c:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 40, "stream": True}
        with httpx.Client(base_url=c.url, timeout=20) as client:
            worst = []
            for _ in range(5):  # the same kept-alive connection each time
                gaps = []
                with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    last = None
                    for _chunk in r.iter_raw():
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                worst.append(sorted(gaps)[int(len(gaps) * 0.9)])
        assert len(c.decodes[0].requests) == 5
        ports = {r.client_port for r in c.decodes[0].requests}
        assert len(ports) == 1  # the gateway reused one pooled connection to the worker
        assert max(worst) < 0.025, f"p90 gap between streamed chunks {max(worst) * 1000:.1f} ms"


def test_upstream_sockets_have_tcp_nodelay() -> None:
    with cluster("nixl") as c:
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 200
        pool = c.gateway.registry.states["decode-0"].target.upstream.pool
        assert pool._idle  # the connection went back to the pool
        for conn in pool._idle:
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def _disconnect_after_two_chunks(url: str, path: str, body: dict) -> None:
    with httpx.Client(timeout=20) as client, \
            client.stream("POST", url + path, json=body, headers={"X-Request-ID": "leaver"}) as r:
        assert r.status_code == 200
        it = r.iter_raw()
        next(it)
        next(it)
        # leaving the block closes the connection mid-stream



@pytest.mark.parametrize("server", [None, "httptools"], ids=["own-server", "uvicorn-httptools"])
def test_client_disconnect_cancels_decode_leg(server: str | None) -> None:
    # the gateway's own server reports the disconnect by callback; under another ASGI server a task
    # waiting in receive() for http.disconnect does
    with cluster("nixl", standin={"decode": {"token_delay_s": 0.05}}, gateway_http=server) as c:
        _disconnect_after_two_chunks(c.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 200,
                                                                 "stream": True})
        assert wait_for(lambda: len(c.decodes[0].cancelled) == 1)  # by the gateway's own id
        assert not c.decodes[0].finished
        assert wait_for(lambda: not c.gateway.registry.states["decode-0"].decodes)  # load released
        assert "conductor_client_disconnects_total 1.0" in httpx.get(c.url + "/metrics").text


def test_client_disconnect_cancels_both_concurrent_legs() -> None:
    # sglang: the prefill leg is still running (slow) while the decode streams; leaving cancels both
    with cluster("sglang", standin={"prefill": {"prefill_delay_s": 30}, "decode": {"token_delay_s": 0.05}}) as c:
        _disconnect_after_two_chunks(c.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 200,
                                                                 "stream": True})
        assert wait_for(lambda: len(c.decodes[0].cancelled) == 1)  # by the gateway's own id
        assert wait_for(lambda: len(c.prefills[0].cancelled) == 1)
