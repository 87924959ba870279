"""Two models and a LoRA adapter behind one gateway, on real vLLM engines (CPU build).

Three engines: the package's mixed-1 ("base": the tiny model, KV events on), and two started here
beside it, "lora" (the tiny model plus a random LoRA adapter, make_tiny_lora.py, KV events on) and
"other" (the same weights served as another model). A vLLM engine answers 404 for a model it does
not serve, so a request the gateway sends to the wrong engine fails outright.

- Two models: `conductor serve --mixed BASE --mixed OTHER`, no model configured: the gateway learns
  who serves what from each engine's /v1/models, and each engine counts only its own model's requests.
- An adapter: requests naming it go only to the engine that lists it, and the gateway predicts the
  cached tokens of an adapter request exactly, which takes vLLM's LoRA extra keys in its block
  hashes (`("lora", name, path)`, vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`): the
  same tokens under the adapter and under the base model are different blocks.

The two engines of this module start side by side once (about a minute on two cores; the package's
mixed pair is already up when test_mixed.py ran first); every test uses prompts of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e_vllm.engines import (
    BLOCK_SIZE,
    GEN,
    HASH_SEED,
    MODEL_NAME,
    TIMINGS,
    Engine,
    EventCollector,
    MixedEngines,
    choice_outputs,
    start_all,
    stop_all,
    words,
)
from tests.e2e_vllm.gateway import GatewayUnderTest, run_gateway
from tests.support.servers import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).resolve().parent
ADAPTER = "tiny-lora"
OTHER = "other"
SUCCESS = "vllm:request_success_total"
# one LoRA slot of rank 8 (the adapter's rank): the smallest LoRA engine vLLM builds
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1")


@dataclass
class Engines:
    lora: Engine  # the tiny model and the adapter ADAPTER; KV events
    base: Engine  # the package's mixed-1: the tiny model; KV events
    other: Engine  # the tiny model's weights served as OTHER
    adapter_path: str
    events: EventCollector  # the lora engine's KV events, read independently of the gateway


def make_tiny_lora(python: str, base: Path, out: Path) -> Path:
    if not (out / "adapter_model.safetensors").exists():
        started = time.monotonic()
        done = subprocess.run(
            [python, str(HERE / "make_tiny_lora.py"), str(base), str(out)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"building the tiny LoRA adapter failed:\n{done.stderr[-3000:]}"
        TIMINGS.append(f"tiny LoRA adapter built in {time.monotonic() - started:.1f} s")
    return out


@pytest.fixture(scope="module")
def engines(mixed_engines: MixedEngines, vllm_python: str, tiny_model: Path, e2e_dir: Path) -> Iterator[Engines]:
    adapter = make_tiny_lora(vllm_python, tiny_model, e2e_dir / "tiny-lora")
    base = mixed_engines.engines["mixed-1"]
    lora = Engine(
        "lora",
        vllm_python,
        tiny_model,
        e2e_dir / "models",
        core=0,
        hash_algo=mixed_engines.hash_algo,
        hash_seed=HASH_SEED,
        kv_events=True,
        extra_args=(*LORA_ARGS, "--lora-modules", f"{ADAPTER}={adapter}"),
    )
    # a later --served-model-name replaces COMMON_ARGS' one
    other = Engine("other", vllm_python, tiny_model, e2e_dir / "models", core=1, extra_args=("--served-model-name", OTHER))
    start_all([lora, other])
    collector = None
    try:
        collector = EventCollector(lora.events_port)
        _until_events(lora, collector)
        yield Engines(lora, base, other, str(adapter), collector)
    finally:
        if collector is not None:
            collector.close()
        stop_all([lora, other])


def _until_events(engine: Engine, collector: EventCollector) -> None:
    """One-block prompts until the collector has a batch: a ZMQ subscriber misses what is published
    before its connection completes."""
    for attempt in range(30):
        engine.post("/v1/completions", {**GEN, "prompt": words(10_000 + 31 * attempt, 40), "max_tokens": 1})
        if wait_for(lambda: collector.snapshot().batches > 0, 2.0):
            return
    raise AssertionError(f"no KV events from {engine.name} reached the test")


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _cards(url: str) -> dict[str, dict[str, Any]]:
    return {card["id"]: card for card in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def _successes(engine: Engine) -> float:
    return engine.metric(SUCCESS)


def _served(engine: Engine, at_least: float) -> bool:
    return _successes(engine) >= at_least


def _received_more(gw: GatewayUnderTest, instance: str, than: int) -> bool:
    return gw.events_received(instance) > than


def test_the_cpu_build_serves_a_lora_adapter(engines: Engines) -> None:
    lora = engines.lora
    cards = _cards(lora.url)
    assert set(cards) == {MODEL_NAME, ADAPTER}, cards
    assert cards[ADAPTER]["parent"] == MODEL_NAME and cards[ADAPTER]["root"] == engines.adapter_path
    assert cards[MODEL_NAME]["parent"] is None
    prompt = words(11_001, 100)  # + BOS: 101 tokens, 3 full blocks
    tuned = lora.post("/v1/completions", {**GEN, "model": ADAPTER, "prompt": prompt})
    plain = lora.post("/v1/completions", {**GEN, "prompt": prompt})
    assert tuned["model"] == ADAPTER and len(tuned["choices"][0]["token_ids"]) == GEN["max_tokens"]
    # the adapter is applied (its B matrices are random, not PEFT's zeros): other answers...
    assert choice_outputs(tuned) != choice_outputs(plain)
    # ...and other blocks: the base model's request found none of the adapter's cached
    assert _cached(plain) == 0
    again = lora.post("/v1/completions", {**GEN, "model": ADAPTER, "prompt": prompt})
    assert _cached(again) == 3 * BLOCK_SIZE and choice_outputs(again) == choice_outputs(tuned)
    # the engine announces the adapter's blocks with its name
    ids = lora.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"]
    assert wait_for(lambda: _adapter_blocks(engines, ids) is not None, 10.0), "no BlockStored names the adapter"


def _adapter_blocks(engines: Engines, ids: list[int]) -> list[int] | None:
    """The hashes the lora engine announced under the adapter for the full blocks of `ids`, in
    order (following BlockStored events parent to child), or None while some are missing."""
    want = len(ids) // BLOCK_SIZE
    chain: list[int] = []
    stored = [ev for ev in engines.events.snapshot().stored if ev.get("lora_name") == ADAPTER]
    while len(chain) < want:
        parent = chain[-1] if chain else None
        start = len(chain) * BLOCK_SIZE
        ev = next(
            (
                e
                for e in stored
                if e["parent_block_hash"] == parent and e["token_ids"] == ids[start : start + len(e["token_ids"])]
            ),
            None,
        )
        if ev is None:
            return None
        chain += ev["block_hashes"][: want - len(chain)]
    return chain


@contextmanager
def conductor_serve(*args: str, log: Path) -> Iterator[str]:
    """`conductor serve ARGS` as an operator starts it (the main venv's Python), until the block ends."""
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        # patient probes, as tests/e2e_vllm/gateway.py gives its gateways: the engines run niced on two cores
        "CONDUCTOR_HEALTH__TIMEOUT_S": "15",
        "CONDUCTOR_HEALTH__UNHEALTHY_AFTER": "4",
        "CONDUCTOR_TIMEOUTS__CONNECT_S": "30",
    }
    command = [sys.executable, "-m", "conductor", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        up = wait_for(lambda: proc.poll() is not None or _ready(url), 60.0, interval=0.2)
        assert up and proc.poll() is None, f"conductor serve did not come up:\n{log.read_text(errors='replace')[-3000:]}"
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _lists(url: str, models: set[str]) -> bool:
    try:
        return models <= set(_cards(url))
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def test_two_models_each_on_its_own_engine(engines: Engines, e2e_dir: Path) -> None:
    base, other = engines.base, engines.other
    assert set(_cards(other.url)) == {OTHER} and set(_cards(base.url)) == {MODEL_NAME}
    before = {e.name: _successes(e) for e in (base, other)}
    with conductor_serve("--mixed", base.url, "--mixed", other.url, log=e2e_dir / "conductor-two-models.log") as url:
        # the gateway reads each engine's /v1/models after its first probe: until then it knows no model
        assert wait_for(lambda: _lists(url, {MODEL_NAME, OTHER}), 30.0), _cards(url)
        for i in range(12):
            model = (MODEL_NAME, OTHER)[i % 2]
            r = httpx.post(url + "/v1/completions", json={**GEN, "model": model, "prompt": words(12_000 + i, 20)}, timeout=120)
            assert r.status_code == 200, f"request {i} for {model}: {r.status_code} {r.text[:300]}"
            assert r.json()["model"] == model
    # an answer can be sent before the engine's counters move: wait for all six on each
    for engine, model in ((base, MODEL_NAME), (other, OTHER)):
        assert wait_for(partial(_served, engine, before[engine.name] + 6), 10.0), f"{engine.name} missed requests"
        assert _successes(engine) - before[engine.name] == 6, f"{engine.name} served another model's requests"
        assert engine.metric(SUCCESS, model_name=model) == _successes(engine)


# ---- the adapter behind a KV-aware gateway ------------------------------------------------------


@pytest.fixture(scope="module")
def gw(engines: Engines) -> Iterator[GatewayUnderTest]:
    lora, base = engines.lora, engines.base
    with run_gateway(
        mixed=[
            {"url": lora.url, "name": "lora", "kv_events_endpoint": lora.events_endpoint},
            {"url": base.url, "name": "base", "kv_events_endpoint": base.events_endpoint},
        ],
        policy="kvcache_aware",
        block_size=BLOCK_SIZE,
        kv={
            "enabled": True,
            "key_mode": "vllm",
            "tokenizer": str(lora.model_dir),
            "vllm_hash_algo": lora.hash_algo,
            "vllm_hash_seed": HASH_SEED,
            "events_silence_s": 3600,
        },
    ) as gateway:
        _subscribed(gateway, engines)
        assert wait_for(lambda: _lists(gateway.url, {MODEL_NAME, ADAPTER}), 30.0), _cards(gateway.url)
        yield gateway


def _subscribed(gw: GatewayUnderTest, engines: Engines) -> None:
    """Until each engine's live events reach the gateway: a ZMQ subscriber misses what is published
    before its connection completes."""
    for name, engine in (("lora", engines.lora), ("base", engines.base)):
        before = gw.events_received(name)
        for attempt in range(30):
            engine.post("/v1/completions", {**GEN, "prompt": words(13_000 + 31 * attempt, 40), "max_tokens": 1})
            if wait_for(partial(_received_more, gw, name, before), 2.0):
                break
        else:
            raise AssertionError(f"no KV events from {name} reached the gateway")


def test_adapter_requests_go_only_to_the_engine_that_lists_it(engines: Engines, gw: GatewayUnderTest) -> None:
    card = _cards(gw.url)[ADAPTER]
    assert card["parent"] == MODEL_NAME and card["root"] == engines.adapter_path
    before = {"lora": _successes(engines.lora), "base": _successes(engines.base)}
    for i in range(6):
        answer, obs = gw.post("/v1/completions", {**GEN, "model": ADAPTER, "prompt": words(14_000 + i, 20)})
        assert obs.prefill == "lora" and answer["model"] == ADAPTER
    assert wait_for(partial(_served, engines.lora, before["lora"] + 6), 10.0)
    assert _successes(engines.lora) - before["lora"] == 6
    assert _successes(engines.base) == before["base"]


def _plant(engines: Engines, gw: GatewayUnderTest, prompt: str) -> tuple[list[int], list[int]]:
    """The prompt cached under the adapter on the lora engine and under the base model on the base
    engine, straight on the engines, until the gateway's index holds both: (base keys, adapter hashes)."""
    engines.lora.post("/v1/completions", {**GEN, "model": ADAPTER, "prompt": prompt, "max_tokens": 1})
    engines.base.post("/v1/completions", {**GEN, "prompt": prompt, "max_tokens": 1})
    ids = engines.base.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"]
    base_keys = gw.keys_of(ids)
    n = len(base_keys)
    assert wait_for(lambda: gw.index_match(base_keys) == {"base": n}, 10.0), gw.index_match(base_keys)
    assert wait_for(lambda: _adapter_blocks(engines, ids) is not None, 10.0), "no BlockStored names the adapter"
    adapter_keys = _adapter_blocks(engines, ids) or []
    assert len(adapter_keys) == n and not set(adapter_keys) & set(base_keys), "vLLM hashed the adapter's blocks as the base's"
    assert wait_for(lambda: set(adapter_keys) <= gw.confirmed_keys("lora"), 10.0), "the adapter's blocks never reached the index"
    return base_keys, adapter_keys


def test_planted_adapter_and_base_prefixes_are_predicted_exactly(engines: Engines, gw: GatewayUnderTest) -> None:
    prefix = words(15_001, 100)  # + BOS: 101 tokens, 3 full blocks under each
    _plant(engines, gw, prefix)
    body = {**GEN, "prompt": prefix + " " + words(15_002, 10)}
    # only the adapter's own hashes (the gateway's keys with ("lora", name, path) mixed in) find its blocks
    answer, obs = gw.post("/v1/completions", {**body, "model": ADAPTER})
    assert obs.prefill == "lora"
    assert _cached(answer) == obs.cached_tokens == 3 * BLOCK_SIZE
    assert obs.predicted_cached_tokens == obs.cached_tokens, "the gateway's keys for an adapter request are not vLLM's"
    # the same tokens for the base model: the base engine's blocks, never the adapter's
    answer, obs = gw.post("/v1/completions", body)
    assert obs.prefill == "base", "kvcache_aware sent a base request away from the base engine's cached prefix"
    assert _cached(answer) == obs.cached_tokens == obs.predicted_cached_tokens == 3 * BLOCK_SIZE


def test_a_repeated_adapter_prompt_is_predicted_exactly(engines: Engines, gw: GatewayUnderTest) -> None:
    prompt = words(16_001, 127)  # + BOS: 128 tokens, 4 full blocks, of which vLLM reuses 3
    body = {**GEN, "model": ADAPTER, "prompt": prompt}
    first, obs1 = gw.post("/v1/completions", body)
    assert obs1.prefill == "lora" and (obs1.predicted_cached_tokens, obs1.cached_tokens) == (0, 0)
    ids = engines.lora.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt})["tokens"]
    assert wait_for(lambda: _adapter_blocks(engines, ids) is not None, 10.0), "no BlockStored names the adapter"
    announced = set(_adapter_blocks(engines, ids) or [])
    assert wait_for(lambda: announced <= gw.confirmed_keys("lora"), 10.0)
    # the same tokens for the base model find nothing, wherever they go: had the gateway keyed the
    # adapter request as the base model's, its dispatch guess would promise them the lora engine's
    # cache (and the repeat below would be "predicted" from that guess alone)
    plain, obs = gw.post("/v1/completions", {**body, "model": MODEL_NAME})
    assert _cached(plain) == obs.cached_tokens == 0
    assert obs.predicted_cached_tokens == 0, f"the adapter's blocks were promised to a base request on {obs.prefill}"
    second, obs2 = gw.post("/v1/completions", body)
    assert obs2.prefill == "lora"
    assert _cached(second) == obs2.cached_tokens == 3 * BLOCK_SIZE
    assert obs2.predicted_cached_tokens == obs2.cached_tokens, "the gateway's keys for an adapter request are not vLLM's"
    assert choice_outputs(first) == choice_outputs(second)
