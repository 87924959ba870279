"""P/D legs answered as vLLM's NixlConnector / MooncakeConnector and SGLang's bootstrap do."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.emulator import Emulator, start_emulator
from tests.support.waiting import wait_for

PROMPT = [(i * 13) % 250 for i in range(100)]  # 6 full blocks + 4 tokens
# each test starts and stops two emulator processes; in CI this file runs beside the real-vLLM
# engines' start-ups, which took both cores long enough to push two of its tests past the default
# 120 s (one waiting for an emulator to exit, one for its answer) in two of three clean-clone runs
pytestmark = pytest.mark.timeout(300)


def post(emu: Emulator, body: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    r = httpx.post(emu.url + "/v1/completions", json={"prompt": PROMPT, **body}, timeout=timeout)
    r.raise_for_status()
    return dict(r.json())


def external_tokens(emu: Emulator) -> float:
    for line in httpx.get(emu.url + "/metrics").text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="external_kv_transfer"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no external_kv_transfer series")


@pytest.fixture(scope="module")
def nixl() -> Iterator[tuple[Emulator, Emulator]]:
    with start_emulator("prefill", "nixl", time_scale=0.01) as p, start_emulator("decode", "nixl", time_scale=0.01) as d:
        yield p, d


def test_nixl_prefill_answers_connector_params(nixl: tuple[Emulator, Emulator]) -> None:
    p, _ = nixl
    request_params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    body = post(p, {"max_tokens": 1, "kv_transfer_params": request_params})
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.engine_id
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
    assert params["remote_request_id"] == body["id"]
    (group,) = params["remote_block_ids"]  # one list per KV cache group
    assert len(group) == 7 and all(isinstance(b, int) for b in group)
    assert params["tp_size"] == 1 and params["remote_num_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 1


def test_nixl_decode_uses_the_params_and_falls_back_without(nixl: tuple[Emulator, Emulator]) -> None:
    p, d = nixl
    params = post(p, {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
    before = external_tokens(d)
    body = post(d, {"max_tokens": 5, "kv_transfer_params": params})
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
    assert external_tokens(d) - before == len(PROMPT)
    assert body["kv_transfer_params"] is None
    # Without kv_transfer_params the decode instance prefills locally; the received KV is now cached.
    local = post(d, {"max_tokens": 2})
    assert local["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert external_tokens(d) - before == len(PROMPT)


def _run_decode(emu: Emulator, body: dict[str, Any], out: dict[str, Any]) -> None:
    out["body"] = post(emu, body, timeout=60)


def _waiting_for_remote_kv(emu: Emulator) -> int:
    return int(httpx.get(emu.url + "/emulator/state", timeout=30).json()["waiting_for_remote_kv"])


def _decode_waits_for_prefill(p: Emulator, d: Emulator, d_body: dict[str, Any], p_body: dict[str, Any]) -> None:
    """The decode leg, sent first, waits (as the emulator's own state shows) until its prefill has run,
    then decodes on the KV that prefill made: every prompt token cached, none computed locally."""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=_run_decode, args=(d, d_body, out))
    thread.start()
    # the default remote_wait_s (120 s) keeps it waiting far longer than this poll can take
    assert wait_for(lambda: _waiting_for_remote_kv(d) == 1), "the decode leg never waited for its prefill"
    assert "body" not in out, "decode answered before its prefill ran"
    p_answer = post(p, p_body)
    thread.join(timeout=60)
    assert out["body"]["usage"]["completion_tokens"] == 4
    assert out["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)  # the prefill's KV
    assert _waiting_for_remote_kv(d) == 0
    assert p_answer["usage"]["completion_tokens"] == 1


def test_mooncake_bootstrap_query_and_concurrent_legs() -> None:
    with start_emulator("prefill", "mooncake", time_scale=0.01) as p, start_emulator("decode", "mooncake", time_scale=0.01) as d:
        query = httpx.get(f"http://127.0.0.1:{p.bootstrap_port}/query").json()
        assert query["0"]["engine_id"] == p.engine_id
        assert query["0"]["worker_addr"] == {"0": {"0": "127.0.0.1:5600"}}
        xfer = "xfer-test-1"
        p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": xfer}
        d_params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": xfer,
            "remote_engine_id": p.engine_id,
            "remote_bootstrap_addr": f"http://127.0.0.1:{p.bootstrap_port}",
        }
        _decode_waits_for_prefill(
            p, d, {"max_tokens": 4, "kv_transfer_params": d_params}, {"max_tokens": 1, "kv_transfer_params": p_params}
        )
        # MooncakeConnector's prefill answers no kv_transfer_params.
        again = post(p, {"max_tokens": 1, "kv_transfer_params": {**p_params, "transfer_id": "xfer-2"}})
        assert again["kv_transfer_params"] is None


def test_sglang_bootstrap_room_pairs_the_legs() -> None:
    with start_emulator("prefill", "sglang", time_scale=0.01) as p, start_emulator("decode", "sglang", time_scale=0.01) as d:
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 12345}
        _decode_waits_for_prefill(p, d, {"max_tokens": 4, **fields}, {"max_tokens": 4, **fields})
        route = httpx.get(f"http://127.0.0.1:{p.bootstrap_port}/route", params={"engine_rank": -1}).json()
        assert route["prefill_dp_size"] == 1


def test_decode_prefills_locally_when_the_prefill_never_comes() -> None:
    with (
        start_emulator("prefill", "mooncake", time_scale=0.01) as p,
        start_emulator("decode", "mooncake", time_scale=0.01, remote_wait_s=1.0) as d,
    ):
        d_params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": "never",
            "remote_engine_id": p.engine_id,
            "remote_bootstrap_addr": f"http://127.0.0.1:{p.bootstrap_port}",
        }
        t0 = time.monotonic()
        body = post(d, {"max_tokens": 2, "kv_transfer_params": d_params})
        # a lower bound the emulator's own 1 s deadline sets: it waited before prefilling locally
        # (no slowness of the machine can make this fail; only not waiting can)
        assert time.monotonic() - t0 >= 1.0
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert body["usage"]["completion_tokens"] == 2
        # A decode leg whose client leaves while it waits for the prefill is aborted and recorded.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                d.url + "/v1/completions",
                headers={"X-Request-ID": "left-waiting"},
                timeout=0.3,
                json={"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": {**d_params, "transfer_id": "never-2"}},
            )
        assert wait_for(lambda: "left-waiting" in httpx.get(d.url + "/emulator/cancelled").json()["request_ids"]), (
            "abort not recorded"
        )
        assert httpx.get(d.url + "/emulator/state").json()["waiting_for_remote_kv"] == 0
