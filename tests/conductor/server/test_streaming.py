"""Streams flow byte for byte as they arrive, with no Nagle/delayed-ACK stall, over pooled
connections; a client that leaves mid-stream cancels every upstream leg."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.support.cluster import cluster
from tests.support.waiting import wait_for


def test_each_chunk_is_relayed_before_the_next_exists_on_a_kept_alive_connection() -> None:
    # The decode worker sends token k+1 only once the client has received token k (lockstep), on
    # one kept-alive connection each way. A chunk the gateway held back (buffered until more came,
    # or stuck behind Nagle's algorithm waiting for an ACK the client delays) would stop the stream:
    # the client's read would time out. No clock is read: what is checked is that every token is
    # passed on before the next one exists, and that both of the gateway's sockets send at once.
    gate = threading.Semaphore(0)
    with cluster("nixl", standin={"decode": {"token_gate": gate}}) as c:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 40, "stream": True}
        with httpx.Client(base_url=c.url, timeout=20) as client:
            for _ in range(5):  # the same kept-alive connection each time
                with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    buffered, events = b"", []
                    for chunk in r.iter_raw():
                        buffered += chunk
                        *complete, buffered = buffered.split(b"\n\n")
                        for event in complete:
                            events.append(event)
                            if len(events) < 40:
                                gate.release()  # token k is here: the worker may send k+1
                assert len(events) == 41 and events[-1] == b"data: [DONE]"
                assert all(b'"text": "x "' in e or b'"text":"x "' in e for e in events[:40])
            # the gateway's end of the client's connection, still open (the client is)
            nodelay = [
                conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for conn in c.servers["gateway"].server.server_state.connections
            ]
        assert nodelay and all(nodelay)
        assert len(c.decodes[0].requests) == 5
        ports = {r.client_port for r in c.decodes[0].requests}
        assert len(ports) == 1  # the gateway reused one pooled connection to the worker


def test_upstream_sockets_have_tcp_nodelay() -> None:
    with cluster("nixl") as c:
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 200
        pool = c.gateway.registry.states["decode-0"].target.upstream.pool
        assert pool._idle  # the connection went back to the pool
        for conn in pool._idle:
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def _disconnect_after_two_chunks(url: str, path: str, body: dict) -> None:
    with (
        httpx.Client(timeout=20) as client,
        client.stream("POST", url + path, json=body, headers={"X-Request-ID": "leaver"}) as r,
    ):
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
        _disconnect_after_two_chunks(
            c.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True}
        )
        assert wait_for(lambda: len(c.decodes[0].cancelled) == 1)  # by the gateway's own id
        assert not c.decodes[0].finished
        assert wait_for(lambda: not c.gateway.registry.states["decode-0"].decodes)  # load released
        assert "conductor_client_disconnects_total 1.0" in httpx.get(c.url + "/metrics").text


def test_client_disconnect_cancels_both_concurrent_legs() -> None:
    # sglang: the prefill leg is still running (slow) while the decode streams; leaving cancels both
    with cluster("sglang", standin={"prefill": {"prefill_delay_s": 30}, "decode": {"token_delay_s": 0.05}}) as c:
        _disconnect_after_two_chunks(
            c.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True}
        )
        assert wait_for(lambda: len(c.decodes[0].cancelled) == 1)  # by the gateway's own id
        assert wait_for(lambda: len(c.prefills[0].cancelled) == 1)
