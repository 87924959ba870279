"""The request path under faults, through the real gateway over real sockets: workers that refuse,
answer 500 forever, stall, or leave a concurrent prefill hanging; clients that reuse ids or send
kv_transfer_params. For each: the client's status, that no work ran twice, that nothing leaked."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conductor.core.types import Observation
from policies.round_robin import RoundRobinPolicy
from tests.support.cluster import Cluster, cluster
from tests.support.waiting import wait_for


def _post(url: str, body: dict[str, object], headers: dict[str, str] | None = None, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3, **body},
        headers=headers or {},
        timeout=timeout,
    )


def _metric(c: Cluster, name: str) -> float:
    text = httpx.get(c.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _nothing_in_flight(c: Cluster) -> bool:
    gw = c.gateway
    return gw.inflight.count == 0 and all(not s.prefills and not s.decodes for s in gw.registry.states.values())


def test_refused_prefill_fails_over_to_another() -> None:
    with cluster("nixl", n_prefill=2, policy_options={}) as c:
        c.servers["prefill-0"].stop()  # nothing listens there any more: connection refused
        statuses = [_post(c.url, {}).status_code for _ in range(4)]
        assert statuses == [200] * 4
        assert len(c.prefills[1].requests) == 4 and len(c.decodes[0].requests) == 4
        assert _metric(c, "conductor_failovers_total") >= 1
        assert _nothing_in_flight(c)


def test_instance_answering_500_forever_is_ejected_while_its_health_is_fine() -> None:
    with cluster("nixl", n_prefill=2, outlier={"consecutive_errors": 3, "ejection_s": 60.0}) as c:
        c.prefills[0].fail_status = 500  # /health still answers 200
        statuses = [_post(c.url, {}).status_code for _ in range(12)]
        assert statuses == [200] * 12  # every failure before a byte was sent fails over
        bad = len(c.prefills[0].requests)
        assert bad == 3  # ejected after 3 in a row, never tried again while ejected
        assert len(c.prefills[1].requests) == 12
        assert _metric(c, "conductor_instance_ejections_total") == 1
        assert c.gateway.registry.states["prefill-0"].healthy is False
        assert c.gateway.ready()[0]  # the other prefill still serves
        assert _nothing_in_flight(c)


def test_every_instance_failing_gives_502_after_bounded_attempts() -> None:
    with cluster("nixl", n_prefill=2, limits={"max_attempts": 2}, outlier={"consecutive_errors": 100}) as c:
        for p in c.prefills:
            p.fail_status = 500
        r = _post(c.url, {})
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        assert sum(len(p.requests) for p in c.prefills) == 2  # limits.max_attempts, not more
        assert not c.decodes[0].requests
        assert _nothing_in_flight(c)


def test_stalled_stream_hits_the_request_deadline() -> None:
    with cluster("nixl", timeouts={"request_s": 1.0}, standin={"decode": {"token_delay_s": 30.0}}) as c:
        with httpx.stream(
            "POST", c.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True}, timeout=30
        ) as r:
            assert r.status_code == 200
            text = r.read().decode()
        assert '"gateway_timeout"' in text and "timeouts.request_s" in text  # an SSE error event, then the end
        assert wait_for(lambda: bool(c.decodes[0].cancelled))  # the worker saw its connection close
        assert wait_for(lambda: _nothing_in_flight(c))


def test_stalled_non_streamed_answer_is_a_504() -> None:
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, timeouts={"request_s": 0.5}, standin={"mixed": {"hang": True}}) as c:
        r = _post(c.url, {})
        assert r.status_code == 504 and r.json()["error"]["code"] == "gateway_timeout"
        assert len(c.mixed[0].requests) == 1  # not retried: the work may be running there
        assert wait_for(lambda: _nothing_in_flight(c))


def test_concurrent_prefill_hanging_after_the_decode_finished() -> None:
    """Mooncake: both legs at once. The decode answers in full while the prefill leg hangs: the
    client gets its answer and [DONE] at once and nothing after it; the prefill leg is closed."""
    with cluster("mooncake", timeouts={"read_s": 0.5}, standin={"prefill": {"hang": True}}) as c:
        with httpx.stream(
            "POST", c.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True}, timeout=30
        ) as r:
            text = r.read().decode()
        assert r.status_code == 200
        assert text.rstrip().endswith("data: [DONE]") and "error" not in text
        assert wait_for(lambda: bool(c.prefills[0].cancelled))  # the hanging prefill leg was closed
        assert wait_for(lambda: _metric(c, "conductor_late_prefill_failures_total") == 1)
        assert _metric(c, 'conductor_requests_total{route="/v1/completions",status="200"}') == 1
        assert wait_for(lambda: _nothing_in_flight(c))


def test_a_client_id_is_echoed_never_used_as_a_key() -> None:
    """Two clients sending one X-Request-ID at once: each gets its own answer, the workers see two
    different gateway ids, and Mooncake pairs each request's two legs by its own transfer id."""
    with cluster("mooncake", standin={"prefill": {"prefill_delay_s": 0.2}}) as c:
        results: list[httpx.Response] = []

        def go() -> None:
            results.append(_post(c.url, {}, {"X-Request-ID": "same-id"}))

        threads = [threading.Thread(target=go) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200]
        assert all(r.headers["x-request-id"] == "same-id" for r in results)
        # concurrent legs: a decode may answer before its prefill leg has even arrived
        assert wait_for(lambda: len(c.prefills[0].requests) == 2)
        worker_ids = {p.headers["x-request-id"] for p in c.prefills[0].requests}
        assert len(worker_ids) == 2 and "same-id" not in worker_ids
        p_tids = {p.body["kv_transfer_params"]["transfer_id"] for p in c.prefills[0].requests}
        d_tids = {d.body["kv_transfer_params"]["transfer_id"] for d in c.decodes[0].requests}
        assert len(p_tids) == 2 and p_tids == d_tids
        bad = _post(c.url, {}, {"X-Request-ID": "a\tb"})  # not a plain token: not echoed
        assert bad.status_code == 200 and bad.headers["x-request-id"] != "a\tb"


@pytest.mark.parametrize("protocol", ["mixed", "nixl", "sglang"])
def test_client_kv_transfer_params_never_reach_a_worker(protocol: str) -> None:
    mixed = protocol == "mixed"
    opts = {"n_prefill": 0, "n_decode": 0, "n_mixed": 1} if mixed else {}
    hostile = {
        "kv_transfer_params": {"remote_host": "169.254.169.254", "remote_port": 80, "do_remote_prefill": True},
        "bootstrap_host": "169.254.169.254",
        "bootstrap_room": 7,
    }
    with cluster("nixl" if mixed else protocol, **opts) as c:
        assert _post(c.url, hostile).status_code == 200
        workers = c.mixed if mixed else c.prefills + c.decodes
        for w in workers:
            for rec in w.requests:
                assert "169.254.169.254" not in json.dumps(rec.body)
                assert rec.body.get("bootstrap_room") != 7


def test_trusted_clients_may_send_kv_transfer_params() -> None:
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, pd={"trust_client_kv_transfer_params": True}) as c:
        assert _post(c.url, {"kv_transfer_params": {"do_remote_decode": True}}).status_code == 200
        assert c.mixed[0].requests[0].body["kv_transfer_params"] == {"do_remote_decode": True}


class _Observing(RoundRobinPolicy):
    def __init__(self) -> None:
        self.observed: list[Observation] = []

    def observe(self, observation: Observation) -> None:
        self.observed.append(observation)


def test_streams_feed_learning_and_read_to_the_end_are_not_499() -> None:
    policy = _Observing()
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1, policy=policy, standin={"mixed": {"cached_tokens": 7}}) as c:
        for _ in range(3):
            with httpx.stream(
                "POST",
                c.url + "/v1/completions",
                timeout=30,
                json={"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
            ) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]"
        assert wait_for(lambda: len(policy.observed) == 3)
        # usage read from the stream's usage chunk, not the last chunk ([DONE]); tokens are the
        # content events (the usage chunk and [DONE] are not tokens)
        assert [(o.cached_tokens, o.output_tokens, o.ok) for o in policy.observed] == [(7, 4, True)] * 3
        assert _metric(c, 'conductor_prompt_tokens_total{source="cached"}') == 21
        assert _metric(c, 'conductor_requests_total{route="/v1/completions",status="200"}') == 3
        assert _metric(c, "conductor_client_disconnects_total") == 0
