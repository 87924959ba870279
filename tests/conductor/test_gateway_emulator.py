"""The gateway in front of emulated vLLM workers (real subprocesses): each P/D protocol end to
end, the legs as the workers recorded them, and the prefill time the worker modelled for a request through the gateway."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from adapters.emulator.profile import load_profile
from conductor.config.settings import load_settings, merge_settings
from conductor.gateway import Gateway
from tests.support.emulator import start_emulator
from tests.support.servers import serve_gateway

# three worker subprocesses and a gateway per test: on a CI box busy with the real vLLM engines'
# start-ups one of these passed the suite's 120 s (building the emulators' SSL context); the
# test's own figures are the workers' records, not times
pytestmark = pytest.mark.timeout(300)


def _gateway(stack: ExitStack, **overrides):
    gateway = Gateway(load_settings(environ={}, overrides=merge_settings({"health": {"interval_s": 1.0}}, overrides)))
    return stack.enter_context(serve_gateway(gateway)), gateway


@pytest.mark.parametrize("protocol", ["nixl", "mooncake", "sglang"])
def test_pd_through_emulated_workers(protocol: str) -> None:
    with ExitStack() as stack:
        p = stack.enter_context(start_emulator("prefill", protocol, time_scale=0.01, model="tiny"))
        d = stack.enter_context(start_emulator("decode", protocol, time_scale=0.01, model="tiny"))
        server, _ = _gateway(
            stack, prefill=[{"url": p.url, "bootstrap_port": p.bootstrap_port}], decode=[d.url], pd={"protocol": protocol}
        )
        prompt = list(range(1, 257))  # 256 token ids: 16 full blocks of 16
        for attempt in range(2):
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=30,
                headers={"X-Request-ID": f"req-{attempt}"},
                json={
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 8,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            assert r.status_code == 200, r.text
            assert r.text.rstrip().endswith("data: [DONE]")
            assert '"completion_tokens":8' in r.text.replace(" ", "")
        p_legs = httpx.get(p.url + "/emulator/requests", timeout=30).json()
        d_legs = httpx.get(d.url + "/emulator/requests", timeout=30).json()
        assert len(p_legs) == len(d_legs) == 2
        p_body, d_body = p_legs[-1]["body"], d_legs[-1]["body"]
        p_headers = {k.lower(): v for k, v in p_legs[-1]["headers"].items()}
        d_headers = {k.lower(): v for k, v in d_legs[-1]["headers"].items()}
        assert p_headers["x-request-id"] == d_headers["x-request-id"] != "req-1"  # the gateway's own id
        assert r.headers["x-request-id"] == "req-1"  # the client's, echoed
        if protocol == "sglang":
            assert p_body["bootstrap_room"] == d_body["bootstrap_room"]
        else:
            assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"] is True
            assert d_body["kv_transfer_params"]["do_remote_prefill"] is True
        if protocol == "mooncake":
            assert p_body["kv_transfer_params"]["transfer_id"] == d_body["kv_transfer_params"]["transfer_id"]
            assert d_body["kv_transfer_params"]["remote_engine_id"] == p.engine_id


def test_repeated_prefix_reported_cached_through_gateway() -> None:
    with ExitStack() as stack:
        m = stack.enter_context(start_emulator("mixed", time_scale=0.01, model="tiny"))
        server, _ = _gateway(stack, mixed=[m.url])
        prompt = [1 + j % 250 for j in range(320)]
        usage = []
        for _ in range(2):
            r = httpx.post(server.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert usage[0] == 0 and usage[1] >= 304  # all full blocks of the second request were cached
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert 'conductor_prompt_tokens_total{source="cached"}' in metrics


def test_8k_prefill_takes_the_profile_time_through_the_gateway() -> None:
    # The published profile: 8,192 tokens, mean TTFT 212.05 ms. Time scale 1, no noise. The worker
    # modelled that time for each prompt the gateway streamed to it, and the gateway's own TTFT
    # observation covers it; how close the wall clock comes is benchmarks/bench_emulator_timing.py.
    with ExitStack() as stack:
        m = stack.enter_context(start_emulator("mixed", time_scale=1.0, noise=0.0, model="tiny"))
        server, gateway = _gateway(stack, mixed=[m.url])
        with httpx.Client(timeout=30) as client:
            for i in range(2):
                prompt = [(i * 7919 + j) % 250 + 1 for j in range(8192)]  # a new prompt each time: no cache
                with client.stream(
                    "POST",
                    server.url + "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True},
                ) as r:
                    assert r.status_code == 200
                    for _ in r.iter_raw():
                        pass
        legs = httpx.get(m.url + "/emulator/requests", timeout=30).json()
        assert len(legs) == 2
        expected = load_profile().prefill_s(8192)
        assert expected == pytest.approx(0.21205, abs=0.002)
        for leg in legs:
            assert len(leg["body"]["prompt"]) == 8192
            (times,) = leg["modelled"]
            assert times["prefill_s"] == pytest.approx(expected, rel=1e-9) and times["queue_s"] == 0.0
            assert times["cached_tokens"] == 0
        # the gateway observed both; a lower bound only (a busy CPU lengthens TTFT, never shortens it)
        sample = gateway.metrics.registry.get_sample_value
        assert sample("conductor_ttft_seconds_count") == 2
        assert sample("conductor_ttft_seconds_sum") >= 2 * expected
