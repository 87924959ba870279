"""What each leg receives, field by field, for every P/D protocol: asserted against what vLLM's
and SGLang's own proxies send (toy_proxy_server.py, mooncake_connector_proxy.py, mini_lb.py)."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.support.cluster import cluster
from tests.support.waiting import wait_for


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=20)


def test_nixl_prefill_first_then_params_verbatim_to_decode() -> None:
    with cluster("nixl", auth={"upstream_api_key": "sk-upstream"}) as c:
        body = {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": 5,
            "stream": True,
            "min_tokens": 2,
            "stream_options": {"include_usage": True},
            "top_k": 7,
            "custom_field": {"a": 1},
        }
        r = _post(c.url, "/v1/completions", body, {"Authorization": "Bearer client-secret", "X-Request-ID": "rid-1"})
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")
        [p] = c.prefills[0].requests
        [d] = c.decodes[0].requests
        gateway_id = p.headers["x-request-id"]  # the gateway's own id; the client's is only echoed
        assert gateway_id != "rid-1" and r.headers["x-request-id"] == "rid-1"
        assert p.body["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        assert p.body["stream"] is False and p.body["max_tokens"] == 1
        assert "stream_options" not in p.body and "min_tokens" not in p.body
        assert p.body["top_k"] == 7 and p.body["custom_field"] == {"a": 1}  # unknown fields pass untouched
        # the decode leg gets the client's body plus the prefill's answer, verbatim
        assert d.body["kv_transfer_params"] == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [1, 2, 3],
            "remote_engine_id": "engine-p0",
            "remote_request_id": gateway_id,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }
        assert {k: v for k, v in d.body.items() if k != "kv_transfer_params"} == body
        assert p.received < d.received  # sequential
        for leg in (p, d):
            assert leg.headers["x-request-id"] == gateway_id
            assert leg.headers["authorization"] == "Bearer sk-upstream"  # never the client's key


def test_nixl_max_completion_tokens_also_set_to_one_for_chat() -> None:
    with cluster("nixl") as c:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
        r = _post(c.url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        [p] = c.prefills[0].requests
        assert p.path == "/v1/chat/completions"
        assert p.body["max_completion_tokens"] == 1 and p.body["max_tokens"] == 1
        [d] = c.decodes[0].requests
        assert d.body["max_completion_tokens"] == 9
        assert "authorization" not in p.headers  # no upstream key configured, client's key is not sent


@pytest.mark.parametrize("shape", ["dp_rank", "engine"])
def test_mooncake_transfer_id_schema_concurrent_legs(shape: str) -> None:
    # the prefill answers only once the decode leg has arrived: legs sent one after the other never overlap
    decode_arrived = threading.Event()
    opts = {"prefill": {"answer_after": decode_arrived}, "decode": {"arrived": decode_arrived}, "bootstrap": {"shape": shape}}
    with cluster("mooncake", standin=opts) as c:
        boot_port = c.gateway.settings.prefill[0].bootstrap_port
        assert c.bootstraps[0].queries >= 1  # engine id read from GET /query at start-up
        r = _post(c.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3}, {"X-Request-ID": "rid-m"})
        assert r.status_code == 200, r.text
        # concurrent legs: the decode may answer before the prefill leg has even arrived (or been answered)
        assert wait_for(lambda: len(c.prefills[0].finished) == 1)
        [p] = c.prefills[0].requests
        [d] = c.decodes[0].requests
        tid = p.body["kv_transfer_params"]["transfer_id"]
        assert p.body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        assert p.body["max_tokens"] == 1 and p.body["stream"] is False
        assert d.body["kv_transfer_params"] == {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": "engine-p0",
            "remote_bootstrap_addr": f"http://127.0.0.1:{boot_port}",
            "transfer_id": tid,
        }
        assert d.body["max_tokens"] == 3
        # concurrent: the decode leg arrived while the prefill leg was still being served
        assert p.released is True
        assert p.headers["x-request-id"] == d.headers["x-request-id"] != "rid-m"  # one gateway id for both legs
        assert r.headers["x-request-id"] == "rid-m"  # the client's, echoed


def test_mooncake_engine_id_schema() -> None:
    with cluster("mooncake", pd={"mooncake_schema": "engine_id"}, standin={"bootstrap": {"shape": "engine"}}) as c:
        r = _post(c.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
        # the legs run concurrently: the gateway may answer before the prefill leg arrives
        assert wait_for(lambda: len(c.prefills[0].requests) == 1, 10.0)
        [p] = c.prefills[0].requests
        [d] = c.decodes[0].requests
        assert p.body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
        assert p.headers["x-data-parallel-rank"] == "0"
        params = d.body["kv_transfer_params"]
        assert params["remote_engine_id"] == "engine-p0" and params["remote_dp_rank"] == 0
        assert params["do_remote_prefill"] is True and "transfer_id" not in params


def test_mooncake_bootstrap_server_schema() -> None:
    with cluster("mooncake", pd={"mooncake_schema": "bootstrap_server"}) as c:
        r = _post(c.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
        [d] = c.decodes[0].requests
        boot_port = c.gateway.settings.prefill[0].bootstrap_port
        assert d.body["kv_transfer_params"] == {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "bootstrap_server_host": "127.0.0.1",
            "bootstrap_server_port": boot_port,
        }
        assert c.bootstraps[0].queries == 0


def test_sglang_same_body_with_bootstrap_fields() -> None:
    decode_arrived = threading.Event()  # the prefill answers only once the decode leg has arrived
    with cluster("sglang", standin={"prefill": {"answer_after": decode_arrived}, "decode": {"arrived": decode_arrived}}) as c:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}
        r = _post(c.url, "/v1/completions", body)
        assert r.status_code == 200
        assert wait_for(lambda: len(c.prefills[0].finished) == 1)  # concurrent: it may end after the answer
        [p] = c.prefills[0].requests
        [d] = c.decodes[0].requests
        assert p.body == d.body
        boot_port = c.gateway.settings.prefill[0].bootstrap_port
        assert p.body["bootstrap_host"] == "127.0.0.1" and p.body["bootstrap_port"] == boot_port
        assert isinstance(p.body["bootstrap_room"], int) and 0 <= p.body["bootstrap_room"] < 2**63
        assert {k: v for k, v in p.body.items() if not k.startswith("bootstrap_")} == body
        assert p.released is True  # concurrent: the decode leg arrived while the prefill leg was held
        assert p.headers["x-request-id"] == d.headers["x-request-id"]
        r2 = _post(c.url, "/v1/completions", body)
        assert r2.status_code == 200
        # the concurrent prefill leg may still be on its way when the decode has answered
        assert wait_for(lambda: len(c.prefills[0].requests) == 2)
        assert c.prefills[0].requests[1].body["bootstrap_room"] != p.body["bootstrap_room"]


def test_mixed_single_leg_body_untouched() -> None:
    with cluster(n_prefill=0, n_decode=0, n_mixed=2) as c:
        body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 2, "logit_bias": {"5": 1}, "echo": False}
        for _ in range(4):
            assert _post(c.url, "/v1/completions", body).status_code == 200
        assert [len(m.requests) for m in c.mixed] == [2, 2]  # round robin
        assert c.mixed[0].requests[0].body == body  # token-id prompt passed through, nothing added


@pytest.mark.parametrize("protocol", ["nixl", "mooncake"])
def test_prefill_leg_samples_one_choice_without_logprobs(protocol: str) -> None:
    """n > 1 on the prefill would start child requests whose KV no decode reads (vLLM hands back one
    prompt's kv_transfer_params); its one token's logprobs are thrown away. The decode samples them."""
    with cluster(protocol) as c:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "n": 3, "logprobs": 2, "best_of": 3}
        r = _post(c.url, "/v1/completions", body)
        assert r.status_code == 200, r.text
        [p] = c.prefills[0].requests
        [d] = c.decodes[0].requests
        assert p.body["n"] == 1 and "logprobs" not in p.body and "best_of" not in p.body
        assert d.body["n"] == 3 and d.body["logprobs"] == 2 and d.body["best_of"] == 3
