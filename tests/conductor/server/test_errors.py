"""Every error case answers its status with an OpenAI-style body; none hangs, none is a 500."""

from __future__ import annotations

import httpx
import pytest

from conductor.core.types import ClusterSnapshot, Decision, Rejection, RequestView
from policies.base import BasePolicy
from tests.support.cluster import cluster
from tests.support.servers import free_port
from tests.support.waiting import wait_for


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.fixture(scope="module")
def c():
    with cluster("nixl", models=["tiny"], limits={"max_body_bytes": 4096}, timeouts={"read_s": 1.0}) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", b"", None),
        ("/v1/completions", b'{"prompt": "x"}', "model"),
        ("/v1/completions", b'{"model": "tiny"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -3}', "max_tokens"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "stream"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', "messages"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"content": "x"}]}', "messages"),
    ],
)
def test_bad_request_400(c, path: str, body: bytes, param: str | None) -> None:
    r = httpx.post(c.url + path, content=body, headers={"content-type": "application/json"})
    err = _assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert not c.prefills[0].requests  # nothing forwarded


def test_unknown_model_404(c) -> None:
    r = httpx.post(c.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    err = _assert_openai_error(r, 404)
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


def test_body_over_limit_413(c) -> None:
    r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 5000})
    assert _assert_openai_error(r, 413)["code"] == "request_too_large"


def test_body_over_limit_without_content_length_413(c) -> None:
    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(c.url + "/v1/completions", content=chunks())
    _assert_openai_error(r, 413)


def test_unknown_route_and_method_are_openai_errors(c) -> None:
    _assert_openai_error(httpx.get(c.url + "/v1/nothing"), 404)
    _assert_openai_error(httpx.get(c.url + "/v1/completions"), 405)


def test_upstream_failure_502_and_worker_4xx_relayed() -> None:
    with cluster("nixl", standin={"prefill": {"fail_status": 500}}) as c:
        err = _assert_openai_error(httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}), 502)
        assert err["type"] == "upstream_error" and "prefill-0" in err["message"]
        assert not c.decodes[0].requests  # a failed prefill never reaches decode
    with cluster("nixl", standin={"prefill": {"fail_status": 400}}) as c:
        err = _assert_openai_error(httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}), 400)
        assert err["message"] == "boom"  # the worker's own words


def test_connection_refused_502() -> None:
    with cluster("nixl", health={"interval_s": 30}) as c:
        # point decode at a port nobody listens on, after start-up found it healthy
        dead = f"http://127.0.0.1:{free_port()}"
        c.gateway.registry.states["decode-0"].target.upstream.base_url = dead
        upstream = c.gateway.registry.states["decode-0"].target.upstream
        loop = c.servers["gateway"].loop
        import asyncio

        asyncio.run_coroutine_threadsafe(upstream.close(), loop).result()
        upstream.base_url = dead
        asyncio.run_coroutine_threadsafe(upstream.start(), loop).result()
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        assert _assert_openai_error(r, 502)["code"] == "bad_gateway"


@pytest.mark.parametrize("stream", [False, True])
def test_502_names_the_instance_not_its_address(stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A worker that refuses the connection: the client learns which instance and what kind of
    failure, never the worker's host and port; the gateway's log keeps the whole story."""
    import asyncio
    import logging

    caplog.set_level(logging.WARNING, logger="conductor")
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, health={"interval_s": 30}) as c:
        port = free_port()  # nobody listens there: pointed at after start-up found the worker healthy
        upstream = c.gateway.registry.states["mixed-0"].target.upstream
        loop = c.servers["gateway"].loop
        asyncio.run_coroutine_threadsafe(upstream.close(), loop).result()
        upstream.base_url = f"http://127.0.0.1:{port}"
        asyncio.run_coroutine_threadsafe(upstream.start(), loop).result()
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream}, timeout=10)
        err = _assert_openai_error(r, 502)
        assert err["code"] == "bad_gateway" and err["message"] == "mixed-0 could not be reached"
        assert "127.0.0.1" not in r.text and str(port) not in r.text
        assert any(f"127.0.0.1:{port}" in record.getMessage() for record in caplog.records)


def test_upstream_timeout_504() -> None:
    with cluster("nixl", timeouts={"read_s": 0.5}, standin={"decode": {"hang": True}}) as c:
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        assert _assert_openai_error(r, 504)["type"] == "upstream_timeout"


def test_no_healthy_instance_503() -> None:
    with cluster("nixl", health={"interval_s": 0.2, "unhealthy_after": 1}) as c:
        c.servers["decode-0"].stop()
        role = c.gateway.registry.states["decode-0"].spec.role
        assert wait_for(lambda: c.gateway.registry.healthy_count(role) == 0), "the stopped decode stayed healthy"
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        assert _assert_openai_error(r, 503)["code"] == "no_healthy_instance"
        assert httpx.get(c.url + "/ready").status_code == 503
        assert httpx.get(c.url + "/health").status_code == 200


class _RejectAll(BasePolicy):
    name = "reject_all"

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        return Decision(
            request.request_id,
            self.name,
            rejection=Rejection(
                "ttft_slo", "predicted TTFT 3.20 s exceeds the TTFT SLO of 1.00 s by 2.20 s", 3.2, 1.0, retry_after_s=2.4
            ),
        )


def test_rejection_429_with_retry_after() -> None:
    with cluster("nixl", policy=_RejectAll()) as c:
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        err = _assert_openai_error(r, 429)
        assert err["code"] == "ttft_slo" and "2.20 s" in err["message"]
        assert r.headers["retry-after"] == "2"
        assert not c.prefills[0].requests and not c.decodes[0].requests
        metrics = httpx.get(c.url + "/metrics").text
        assert 'conductor_rejections_total{reason="ttft_slo"} 1.0' in metrics


def test_api_key_401() -> None:
    with cluster("nixl", auth={"api_keys": ["sk-good"]}) as c:
        body = {"model": "tiny", "prompt": "x"}
        assert _assert_openai_error(httpx.post(c.url + "/v1/completions", json=body), 401)["type"] == "authentication_error"
        bad = httpx.post(c.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        _assert_openai_error(bad, 401)
        good = httpx.post(c.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-good"})
        assert good.status_code == 200
        _assert_openai_error(httpx.get(c.url + "/v1/models"), 401)


def test_inflight_limit_503_without_queueing() -> None:
    from tests.support.waiting import wait_for

    # the first request holds the only slot for as long as this test keeps its stream open (up to
    # 400 tokens at 50 ms: far longer than the test needs, however busy the machine)
    with cluster("nixl", limits={"max_inflight_requests": 1}, standin={"decode": {"token_delay_s": 0.05}}) as c:
        with httpx.stream(
            "POST",
            c.url + "/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "x", "max_tokens": 400, "stream": True},
        ) as slow:
            assert slow.status_code == 200
            chunks = slow.iter_bytes()  # kept: a dropped iterator would close the stream
            next(chunks)  # answering: admitted and in flight
            assert c.gateway.inflight.count == 1
            r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
            err = _assert_openai_error(r, 503)
            assert err["code"] == "overloaded" and r.headers["retry-after"] == "1"
        # the client went away: the slot is given back
        assert wait_for(lambda: c.gateway.inflight.count == 0, 10.0)
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 200
