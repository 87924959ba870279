"""The gateway in front of a real vLLM prefill/decode pair: NIXL and Mooncake connectors on the CPU.

Per protocol, one prefill engine (core 0) and one decode engine (core 1) start for all the tests of
that protocol; pytest runs one protocol's tests, stops its pair, then starts the other's.

What is checked against the real connectors: the answers through P/D are what one engine answers
alone (the prefill engine asked directly, without kv_transfer_params, is that mixed engine), the
decode engine computed no prompt token itself (its KV came over the connector: vLLM counts prompt
tokens by source, and `local_compute` must not move), batched prompts split per prompt by the
gateway merge into the engine's own batch answer, and streams end with the usage chunk and [DONE].
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e_vllm.engines import (
    BLOCK_SIZE,
    MODEL_NAME,
    Engine,
    choice_outputs,
    pd_connector,
    python_imports,
    start_all,
    stop_all,
    stream_result,
    words,
)
from tests.e2e_vllm.gateway import GatewayUnderTest, run_gateway
from tests.support.ci import require
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(900)  # a pair starts inside the first test's setup

GEN = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


@dataclass
class PD:
    protocol: str
    prefill: Engine
    decode: Engine
    gw: GatewayUnderTest


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pd(request: pytest.FixtureRequest, vllm_python: str, tiny_model: Path, e2e_dir: Path) -> Iterator[PD]:
    protocol: str = request.param
    needed = "nixl._api" if protocol == "nixl" else "mooncake.engine"
    missing = python_imports(vllm_python, needed)
    require(missing is None, f"{protocol}: `import {needed}` fails under {vllm_python}: {missing} (bash .ci/vllm.sh installs it)")
    engines = []
    for core, (kind, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        config, env = pd_connector(protocol, role)
        engines.append(
            Engine(
                f"{protocol}-{kind}",
                vllm_python,
                tiny_model,
                e2e_dir / protocol,
                core=core,
                hash_algo="sha256",
                kv_events=kind == "prefill",
                kv_transfer_config=config,
                extra_env=env,
            )
        )
    p, d = engines
    start_all(engines)
    try:
        prefill: dict[str, Any] = {"url": p.url, "kv_events_endpoint": p.events_endpoint}
        if protocol == "mooncake":
            prefill["bootstrap_port"] = int(p.extra_env["VLLM_MOONCAKE_BOOTSTRAP_PORT"])
        # sha256 with vLLM's default seed (no PYTHONHASHSEED on either side): the other half of the
        # hash settings next to the mixed module's xxhash with a seed
        with run_gateway(
            pd={"protocol": protocol},
            prefill=[prefill],
            decode=[d.url],
            policy="kvcache_aware",
            block_size=BLOCK_SIZE,
            kv={"enabled": True, "key_mode": "vllm", "tokenizer": str(tiny_model), "vllm_hash_algo": "sha256"},
        ) as gw:
            if protocol == "nixl":
                warm_nixl_handshake(gw)
            yield PD(protocol, p, d, gw)
    finally:
        stop_all(engines)


def warm_nixl_handshake(gw: GatewayUnderTest) -> None:
    """The two engines' first NIXL transfer makes their side-channel handshake, which vLLM waits 5 s
    for (hard-coded, nixl/base_worker.py); on a saturated CI box it can miss that, and the decode
    answers the first request with a 500 (seen in CI: `handshake_setup_failed`, zmq Again). The next
    transfer handshakes again. So one short request (no full block: nothing indexed) gets up to
    three tries before the tests; every request of the tests themselves must then succeed."""
    statuses = []
    for _ in range(3):
        r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "warm up", "max_tokens": 1}, timeout=120)
        statuses.append(r.status_code)
        if r.status_code == 200:
            return
    raise AssertionError(f"no NIXL transfer succeeded in three tries: {statuses} (see the decode engine's log)")


def assert_no_reprefill(pd: PD, before: dict[str, float], prompt_tokens: int) -> None:
    """Every prompt token of the requests since `before` reached the decode engine over the
    connector, and it computed none itself."""

    def counted() -> bool:  # the counters are updated as outputs are processed: they may trail an answer
        after = pd.decode.prompt_tokens_by_source()
        return after["external_kv_transfer"] - before["external_kv_transfer"] >= prompt_tokens

    wait_for(counted, 10.0)
    after = pd.decode.prompt_tokens_by_source()
    assert after["local_compute"] == before["local_compute"], f"the decode engine re-prefilled: {before} -> {after}"
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens, (before, after)


def _usage(answer: dict[str, Any]) -> dict[str, int]:
    return {k: answer["usage"][k] for k in USAGE_KEYS}


def test_pd_answers_are_one_engines_and_the_decode_does_not_prefill(pd: PD) -> None:
    requests = [
        ("/v1/completions", {**GEN, "prompt": words(1101, 150)}),
        ("/v1/completions", {**GEN, "prompt": words(1102, 400)}),
        (
            "/v1/chat/completions",
            {**GEN, "messages": [{"role": "system", "content": words(1103, 50)}, {"role": "user", "content": words(1104, 90)}]},
        ),
    ]
    before = pd.decode.prompt_tokens_by_source()
    answers = []
    for route, body in requests:
        answer, obs = pd.gw.post(route, body)
        assert (obs.prefill, obs.decode) == ("prefill-0", "decode-0")
        answers.append(answer)
    assert_no_reprefill(pd, before, sum(a["usage"]["prompt_tokens"] for a in answers))

    # the mixed engine's answers, asked after the P/D ones so that those prefilled cold
    for (route, body), answer in zip(requests, answers, strict=True):
        direct = pd.prefill.post(route, body)
        assert choice_outputs(answer) == choice_outputs(direct)
        assert len(answer["choices"][0]["token_ids"]) == GEN["max_tokens"]
        assert _usage(answer) == _usage(direct)


def test_pd_repeated_prefix_is_predicted_on_the_prefill(pd: PD) -> None:
    # the prefill engine's KV events feed the index (sha256, vLLM's default seed): a repeat of a
    # prompt is predicted exactly as cached as the prefill leg reports it
    body = {**GEN, "prompt": words(1201, 200)}
    _, obs1 = pd.gw.post("/v1/completions", body)
    assert obs1.predicted_cached_tokens == 0 and obs1.cached_tokens == 0
    ids = pd.prefill.post("/tokenize", {"model": MODEL_NAME, "prompt": body["prompt"]})["tokens"]
    keys = pd.gw.keys_of(ids)
    assert len(keys) == 6
    # confirmed by the prefill engine's events, not only guessed from the gateway's dispatch
    assert wait_for(lambda: set(keys) <= pd.gw.confirmed_keys("prefill-0"), 10.0)
    second, obs2 = pd.gw.post("/v1/completions", body)
    assert obs2.cached_tokens == obs2.predicted_cached_tokens == 200 // BLOCK_SIZE * BLOCK_SIZE
    assert choice_outputs(second) == choice_outputs(pd.prefill.post("/v1/completions", body))


@pytest.mark.parametrize("stream", [False, True])
def test_pd_batched_prompts_merge_into_the_engines_batch_answer(pd: PD, stream: bool) -> None:
    seed = 1300 + 10 * stream
    prompts = ["a b c", "d e f", words(seed + 1, 70), words(seed + 2, 33)]
    body = {**GEN, "prompt": prompts, "max_tokens": 8}
    before = pd.decode.prompt_tokens_by_source()
    if stream:
        raw, _ = pd.gw.stream("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
        texts, usage, data = stream_result(raw)
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        assert usage is not None
        assert_no_reprefill(pd, before, usage["prompt_tokens"])
    else:
        answer, _ = pd.gw.post("/v1/completions", body)
        assert_no_reprefill(pd, before, answer["usage"]["prompt_tokens"])

    direct = pd.prefill.post("/v1/completions", body)
    if stream:
        assert texts == {i: text for i, text, _, _ in choice_outputs(direct)}
        assert usage is not None and {k: usage[k] for k in USAGE_KEYS} == _usage(direct)
    else:
        assert choice_outputs(answer) == choice_outputs(direct)
        assert _usage(answer) == _usage(direct)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_pd_streams_end_with_usage_then_done(pd: PD, route: str) -> None:
    seed = 1400 if route == "/v1/completions" else 1401
    body: dict[str, Any] = (
        {**GEN, "prompt": words(seed, 120)}
        if route == "/v1/completions"
        else {**GEN, "messages": [{"role": "user", "content": words(seed, 120)}]}
    )
    before = pd.decode.prompt_tokens_by_source()
    raw, obs = pd.gw.stream(route, {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts, usage, data = stream_result(raw)
    assert usage is not None
    assert_no_reprefill(pd, before, usage["prompt_tokens"])
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    last = json.loads(data[-2])
    assert last["choices"] == [] and last["usage"] == usage, "the usage chunk must come last, before [DONE]"
    direct = pd.prefill.post(route, body)
    assert usage is not None and {k: usage[k] for k in USAGE_KEYS} == _usage(direct)
    assert texts == {0: choice_outputs(direct)[0][1]}
    # the gateway timed the stream it relayed: a first token, and a spacing sample for each later
    # read that held tokens (a loaded box may deliver the whole stream in one read: then none);
    # chat streams open with a role-only event before the first token's, one gap more at most
    assert obs.ttft_s is not None and obs.output_tokens == usage["completion_tokens"]
    most = obs.output_tokens - (route == "/v1/completions")
    assert len(obs.token_intervals_s) <= most and all(i >= 0 for i in obs.token_intervals_s)
