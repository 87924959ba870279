"""The gateway in front of two real vLLM engines in mixed (non-disaggregated) mode, KV-aware.

What only real engines can show: that the gateway's tokenizer, chat template and block hashes are
vLLM's own (the index predicts exactly the cached tokens vLLM reports, and holds exactly the blocks
vLLM announced), that vLLM's KV event wire format still decodes, and that answers through the
gateway are the engine's answers byte for byte.

Both engines start once for the module (about a minute, side by side on the two cores); every test
uses prompts of its own, so the tests do not depend on their order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest

from tests.e2e_vllm.engines import (
    BLOCK_SIZE,
    GEN,
    HASH_SEED,
    MODEL_NAME,
    Engine,
    EventCollector,
    MixedEngines,
    choice_outputs,
    metric_sum,
    stream_result,
    words,
)
from tests.e2e_vllm.gateway import GatewayUnderTest, run_gateway
from tests.support.waiting import wait_for

# The package's engines may start inside the first test's setup: far beyond the suite's 120 s default.
pytestmark = pytest.mark.timeout(900)


@dataclass
class Mixed:
    engines: dict[str, Engine]  # by gateway instance name: mixed-0, mixed-1
    events: dict[str, EventCollector]
    gw: GatewayUnderTest
    hash_algo: str


def nudge(engine: Engine) -> None:
    """One tiny request (no full block, so nothing cached): vLLM publishes the KV events it queued
    (AllBlocksCleared after a reset among them) only when its scheduler takes a step."""
    engine.post("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": 1})


def reset(engine: Engine) -> None:
    """Empty the engine's prefix cache (VLLM_SERVER_DEV_MODE) and have the event published."""
    engine.reset_prefix_cache()
    nudge(engine)


def _sync(m: Mixed) -> None:
    """Bring the gateway's index and this test's own event log to the same, empty, starting point.

    A ZMQ subscriber misses what was published before its connection completed, so first a
    one-block request per engine until both subscribers have seen a batch, then a prefix cache
    reset, after which neither view holds anything it could have missed.
    """
    for name, engine in m.engines.items():

        def subscribed(n: str = name) -> bool:
            return m.events[n].snapshot().batches > 0 and m.gw.events_received(n) > 0

        def cleared(n: str = name) -> bool:
            return m.events[n].snapshot().cleared > 0 and not m.gw.confirmed_keys(n)

        for attempt in range(30):
            engine.post("/v1/completions", {"model": MODEL_NAME, "prompt": words(9000 + 31 * attempt, 40), "max_tokens": 1})
            if wait_for(subscribed, 2.0):
                break
        else:
            raise AssertionError(f"no KV events from {name} reached the gateway and the test")
        reset(engine)
        assert wait_for(cleared, 10.0), f"{name}: AllBlocksCleared did not empty the index"


@pytest.fixture(scope="module")
def mixed(mixed_engines: MixedEngines) -> Iterator[Mixed]:
    engines, algo = mixed_engines.engines, mixed_engines.hash_algo
    collectors: dict[str, EventCollector] = {}
    try:
        collectors = {name: EventCollector(e.events_port) for name, e in engines.items()}
        e0, e1 = engines["mixed-0"], engines["mixed-1"]
        with run_gateway(
            # mixed-0's events as a worker's config names them (instance kv_events_endpoint), mixed-1's
            # through kv.kv_events with the replay socket and topic: both ways the settings allow
            mixed=[{"url": e0.url, "kv_events_endpoint": e0.events_endpoint}, {"url": e1.url}],
            policy="kvcache_aware",
            block_size=BLOCK_SIZE,
            kv={
                "enabled": True,
                "key_mode": "vllm",
                "tokenizer": str(e0.model_dir),
                "vllm_hash_algo": algo,
                "vllm_hash_seed": HASH_SEED,
                # the silence watchdog (no events and a failed /health: drop the instance) would also
                # empty a restarting engine's entries; pushed out of the way so that the restart test
                # proves the event stream's own signal (its sequence numbers start over)
                "events_silence_s": 3600,
                "kv_events": {
                    "mixed-1": {"endpoint": e1.events_endpoint, "replay_endpoint": e1.replay_endpoint, "topic": "kv-events"}
                },
            },
        ) as gw:
            m = Mixed(engines, collectors, gw, algo)
            _sync(m)
            yield m
    finally:
        for c in collectors.values():
            c.close()


def assert_confirmed(gw: GatewayUnderTest, instance: str, token_ids: list[int]) -> None:
    """The gateway's keys for these tokens become event-confirmed entries of `instance`."""
    keys = set(gw.keys_of(token_ids))
    assert keys, "the prompt holds no full block"
    assert wait_for(lambda: keys <= gw.confirmed_keys(instance), 10.0), (
        f"{instance}: the engine's KV events never confirmed the gateway's block keys for the prompt"
    )


def index_is(gw: GatewayUnderTest, keys: list[int], expected: dict[str, int]) -> bool:
    return gw.index_match(keys) == expected


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("words_in_prompt", [100, 127])
def test_completions_are_the_engines_and_cached_tokens_are_predicted(mixed: Mixed, words_in_prompt: int) -> None:
    # 100 words + BOS = 101 tokens: 3 full blocks; 127 + BOS = 128 tokens, exactly 4 blocks, of
    # which vLLM reuses only 3 (it always computes the last prompt token), and so must the index
    prompt = words(1 + words_in_prompt, words_in_prompt)
    body = {**GEN, "prompt": prompt}
    first, obs1 = mixed.gw.post("/v1/completions", body)
    assert obs1.prefill in mixed.engines and obs1.decode is None
    engine = mixed.engines[obs1.prefill]
    # the gateway tokenized the text itself and forwarded token ids: the engine counted the same tokens
    assert first["usage"]["prompt_tokens"] == obs1.prompt_tokens == words_in_prompt + 1
    assert (obs1.predicted_cached_tokens, obs1.cached_tokens) == (0, 0)
    # the engine's events confirm the gateway's own keys for the prompt: without this the
    # prediction below could rest on the gateway's dispatch guess alone, right with wrong hashes
    ids = engine.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"]
    assert_confirmed(mixed.gw, obs1.prefill, ids)

    second, obs2 = mixed.gw.post("/v1/completions", body)
    full_blocks = (words_in_prompt + 1 - 1) // BLOCK_SIZE
    assert obs2.prefill == obs1.prefill, "kvcache_aware sent a repeated prompt away from its cache"
    assert _cached(second) == obs2.cached_tokens == full_blocks * BLOCK_SIZE
    assert obs2.predicted_cached_tokens == obs2.cached_tokens, "the index's block keys are not vLLM's"

    direct = engine.post("/v1/completions", body)
    assert choice_outputs(first) == choice_outputs(second) == choice_outputs(direct)
    assert len(direct["choices"][0]["token_ids"]) == GEN["max_tokens"]
    assert {k: first["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        k: direct["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }


def test_chat_is_the_engines_and_its_template_hashes_match(mixed: Mixed) -> None:
    # the gateway renders the chat template itself (jinja2) and keys the result: a rendering that
    # differs from vLLM's by one token would show as a wrong prediction of the cached tokens
    messages = [{"role": "system", "content": words(201, 40)}, {"role": "user", "content": words(202, 60)}]
    body = {**GEN, "messages": messages}
    first, obs1 = mixed.gw.post("/v1/chat/completions", body)
    assert obs1.prefill is not None
    ids = mixed.engines[obs1.prefill].post("/tokenize", {"model": MODEL_NAME, "messages": messages})["tokens"]
    assert_confirmed(mixed.gw, obs1.prefill, ids)
    second, obs2 = mixed.gw.post("/v1/chat/completions", body)
    # BOS <|system|> 40 words <|user|> 60 words <|assistant|>
    assert first["usage"]["prompt_tokens"] == obs1.prompt_tokens == 104
    assert obs2.prefill == obs1.prefill
    assert _cached(second) == obs2.cached_tokens == obs2.predicted_cached_tokens == 3 * BLOCK_SIZE
    direct = mixed.engines[obs1.prefill].post("/v1/chat/completions", body)
    assert choice_outputs(first) == choice_outputs(second) == choice_outputs(direct)


def test_the_index_holds_what_the_engines_announced(mixed: Mixed) -> None:
    gw = mixed.gw
    # blocks that reach the index only through events (sent straight to the engines), and one
    # prompt through the gateway (its dispatch guess must be confirmed by the same events)
    sent: dict[str, list[str]] = {"mixed-0": [words(301, 90), words(302, 200)], "mixed-1": [words(303, 150)]}
    for name, prompts in sent.items():
        for prompt in prompts:
            mixed.engines[name].post("/v1/completions", {**GEN, "prompt": prompt})
    _, obs = gw.post("/v1/completions", {**GEN, "prompt": words(304, 120)})
    assert obs.prefill is not None
    sent[obs.prefill].append(words(304, 120))

    for name, engine in mixed.engines.items():
        events = mixed.events[name]
        token_ids = [engine.post("/tokenize", {"model": MODEL_NAME, "prompt": p})["tokens"] for p in sent[name]]
        wanted = {key for ids in token_ids for key in gw.keys_of(ids)}

        # first every announced block has arrived (an answer can overtake its own events), then the
        # index and this test's own reading of the events agree on everything the engine holds
        def arrived(ev: EventCollector = events, keys: set[int] = wanted) -> bool:
            return keys <= ev.snapshot().held

        def agree(n: str = name, ev: EventCollector = events) -> bool:
            return gw.confirmed_keys(n) == ev.snapshot().held

        assert wait_for(arrived, 10.0), f"{name}: the engine never announced the blocks of its prompts"
        assert wait_for(agree, 10.0), (
            f"{name}: index {sorted(gw.confirmed_keys(name))[:5]}... != events {sorted(events.snapshot().held)[:5]}..."
        )
        log = events.snapshot()
        assert not events.errors, events.errors
        assert log.gaps == 0 and log.held
        for prompt, ids in zip(sent[name], token_ids, strict=True):
            # the gateway's tokenizer agrees with the engine's...
            assert gw.on_loop(partial(gw.analyzer.tokenizer.encode_prompt, prompt)) == ids
            # ...and its block keys are the hashes vLLM announced for those tokens, block for block
            keys = gw.keys_of(ids)
            assert len(keys) == len(ids) // BLOCK_SIZE and set(keys) <= log.held
            stored = next(ev for ev in log.stored if ev["block_hashes"][0] == keys[0])
            assert stored["parent_block_hash"] is None and stored["block_size"] == BLOCK_SIZE
            n = min(len(keys), len(stored["block_hashes"]))
            assert stored["block_hashes"][:n] == keys[:n]
            assert stored["token_ids"][: n * BLOCK_SIZE] == ids[: n * BLOCK_SIZE]
            assert gw.index_match(keys).get(name) == len(keys)


def test_a_prefix_planted_on_one_engine_draws_its_requests(mixed: Mixed) -> None:
    gw = mixed.gw
    # 639 words + BOS = 640 tokens = 20 blocks, planted straight on the engines (the gateway never
    # saw these prompts: only the engines' KV events can tell it where they are)
    planted = {"mixed-1": words(401, 639), "mixed-0": words(402, 639)}
    for name, prompt in planted.items():
        mixed.engines[name].post("/v1/completions", {**GEN, "prompt": prompt, "max_tokens": 1})
        ids = mixed.engines[name].post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"]
        keys = gw.keys_of(ids)
        assert len(keys) == 20
        assert wait_for(partial(index_is, gw, keys, {name: 20}), 10.0), (
            f"{name}: planted blocks never reached the index: {gw.index_match(keys)}"
        )

    # two requests in a row per prefix to the same engine: what round robin can never do
    for name, prompt in planted.items():
        for suffix in (411, 412):
            answer, obs = gw.post("/v1/completions", {**GEN, "prompt": prompt + " " + words(suffix, 10)})
            assert obs.prefill == name, f"a request sharing {name}'s 20 cached blocks went to {obs.prefill}"
            assert _cached(answer) == obs.cached_tokens == obs.predicted_cached_tokens == 20 * BLOCK_SIZE
    records = [json.loads(line) for line in gw.decisions[-4:]]
    assert [r["prefill"] for r in records] == ["mixed-1", "mixed-1", "mixed-0", "mixed-0"]
    assert all(r["policy"] == "kvcache_aware" for r in records)


def test_a_prefix_cache_reset_empties_that_engines_index_entries(mixed: Mixed) -> None:
    gw = mixed.gw
    target, other = mixed.engines["mixed-0"], mixed.engines["mixed-1"]
    prompt = words(501, 300)
    other_prompt = words(502, 300)
    target.post("/v1/completions", {**GEN, "prompt": prompt})
    other.post("/v1/completions", {**GEN, "prompt": other_prompt})
    keys = gw.keys_of(target.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"])
    other_keys = gw.keys_of(other.post("/tokenize", {"model": MODEL_NAME, "prompt": other_prompt})["tokens"])
    assert wait_for(lambda: gw.index_match(keys) == {"mixed-0": len(keys)}, 10.0)
    assert wait_for(lambda: gw.index_match(other_keys) == {"mixed-1": len(other_keys)}, 10.0)
    assert wait_for(lambda: gw.confirmed_keys("mixed-1") == mixed.events["mixed-1"].snapshot().held, 10.0)
    kept = gw.confirmed_keys("mixed-1")
    cleared_before = mixed.events["mixed-0"].snapshot().cleared

    reset(target)  # AllBlocksCleared: what a restarted engine's first events amount to as well
    assert wait_for(lambda: mixed.events["mixed-0"].snapshot().cleared > cleared_before, 10.0)
    assert wait_for(lambda: not gw.confirmed_keys("mixed-0"), 10.0), "the index kept a reset engine's blocks"
    assert gw.index_match(keys) == {}
    assert kept and gw.confirmed_keys("mixed-1") == kept, "the other engine's entries must stay"
    # and the gateway no longer promises a hit that is gone
    answer, obs = gw.post("/v1/completions", {**GEN, "prompt": prompt})
    assert obs.predicted_cached_tokens == obs.cached_tokens == _cached(answer) == 0


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streams_end_with_usage_then_done(mixed: Mixed, route: str) -> None:
    if route == "/v1/completions":
        body: dict[str, Any] = {**GEN, "prompt": words(601, 110)}
    else:
        body = {**GEN, "messages": [{"role": "user", "content": words(602, 110)}]}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    raw1, obs1 = mixed.gw.stream(route, streamed)
    raw2, obs2 = mixed.gw.stream(route, streamed)
    direct = mixed.engines[obs1.prefill or ""].post(route, body)
    for raw in (raw1, raw2):
        texts, usage, data = stream_result(raw)
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        last = json.loads(data[-2])
        assert last["choices"] == [] and last["usage"] == usage, "the usage chunk must come last, before [DONE]"
        assert usage is not None and usage["completion_tokens"] == GEN["max_tokens"]
        assert usage["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        assert texts == {0: choice_outputs(direct)[0][1]}
    # the gateway learns cached tokens from the usage chunk of a stream too
    _, usage2, _ = stream_result(raw2)
    assert usage2 is not None and obs2.prefill == obs1.prefill
    assert obs2.cached_tokens == usage2["prompt_tokens_details"]["cached_tokens"] == obs2.predicted_cached_tokens > 0


def test_an_engine_restart_empties_its_index_entries(mixed: Mixed) -> None:
    gw, engine = mixed.gw, mixed.engines["mixed-1"]
    prompt = words(701, 200)
    engine.post("/v1/completions", {**GEN, "prompt": prompt})
    keys = gw.keys_of(engine.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"])
    assert wait_for(lambda: gw.index_match(keys).get("mixed-1") == len(keys), 10.0)

    engine.restart()  # same ports, same hash seed; its prefix cache starts empty
    # the first batch of the new process (sequence numbers start over) is the gateway's cue; one
    # block of a fresh prompt makes the engine publish it
    fresh = words(702, 40)
    engine.post("/v1/completions", {"model": MODEL_NAME, "prompt": fresh, "max_tokens": 1})
    fresh_keys = set(gw.keys_of(engine.post("/tokenize", {"model": MODEL_NAME, "prompt": fresh})["tokens"]))
    events = mixed.events["mixed-1"]
    assert wait_for(lambda: events.snapshot().restarts > 0, 10.0)
    # the new life's blocks, and none of the old: the gateway's KV canary re-runs on the restart
    # (conductor/kv/canary.py), so the blocks of its own prompts are held beside the fresh ones
    old = set(keys)
    assert wait_for(lambda: fresh_keys <= gw.confirmed_keys("mixed-1") and not gw.confirmed_keys("mixed-1") & old, 10.0), (
        "the index kept blocks of the engine's previous life"
    )
    assert wait_for(lambda: fresh_keys <= events.snapshot().held and not events.snapshot().held & old, 10.0)
    assert gw.index_match(keys) == {}
    # back in rotation before the next test: the gateway's health probe has seen it again
    assert wait_for(
        lambda: metric_sum(httpx.get(gw.url + "/metrics").text, "conductor_instance_healthy", instance="mixed-1") == 1, 30.0
    )
    answer, obs = gw.post("/v1/completions", {**GEN, "prompt": prompt})
    assert obs.predicted_cached_tokens == obs.cached_tokens == _cached(answer) == 0
