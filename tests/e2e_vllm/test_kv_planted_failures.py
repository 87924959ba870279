"""Planted failures of the KV index in front of real engines: the gateway notices and names the cause.

Every test replays one situation against the package's two mixed engines, which are set up right
(KV events on, PYTHONHASHSEED set, prefix caching): prefixes planted straight on both engines (as an
earlier life of the gateway, another replica or a warm-up would leave them), then a gateway started
with one thing wrong in its own settings, then requests through it that extend those prefixes.
Whichever engine serves a request finds the prefix cached and says so (usage.prompt_tokens_details.
cached_tokens); only an index that reads the engines right predicts it. The control gateway, set up
right, sees the same sequence with full coverage and no alarm: the alarms below are the planted
settings' doing, not the sequence's.

Each planted failure is caught first by the KV canary (conductor/kv/canary.py), while the gateway
starts, before any client request: /ready's kv_canary detail names it per engine, with the setting to
fix, and one log line says so. The agreement alarm that follows confirms it from client traffic. Last,
a real engine restart: its entries leave the index with its first new event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from itertools import count
from typing import Any

import httpx
import pytest

from conductor.core.types import Observation
from tests.e2e_vllm.engines import BLOCK_SIZE, GEN, HASH_SEED, MixedEngines, metric_sum, words
from tests.e2e_vllm.gateway import GatewayUnderTest, run_gateway
from tests.support.servers import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(900)

PREFIX_WORDS = 191  # + BOS = 192 tokens: 6 full blocks planted on each engine
PLANTED_TOKENS = 6 * BLOCK_SIZE
REQUESTS = 8  # through the gateway, round robin over the two engines: 4 each
MIN_SAMPLES = 3  # kv.agreement_min_samples: an instance may raise its alarm from its third hit on
MAX_EXTRA = 6  # further requests while evidence (events trail answers) settles the named cause
_seeds = count(20_000, 100)  # prompts of their own for every test


def _kv_right(m: MixedEngines, **changes: Any) -> dict[str, Any]:
    """The gateway's kv settings that match the engines (with events from their replay sockets),
    changed as a test plants."""
    kv: dict[str, Any] = {
        "enabled": True,
        "key_mode": "vllm",
        "tokenizer": str(m.engines["mixed-0"].model_dir),
        "vllm_hash_algo": m.hash_algo,
        "vllm_hash_seed": HASH_SEED,
        "agreement_min_samples": MIN_SAMPLES,
        "events_silence_s": 3600,
        # the engines' events trail their answers by seconds on a busy 2-core box (CI): time to arrive
        "canary_timeout_s": 10.0,
        "kv_events": {
            name: {"endpoint": e.events_endpoint, "replay_endpoint": e.replay_endpoint, "topic": "kv-events"}
            for name, e in m.engines.items()
        },
    }
    kv.update(changes)
    return kv


def _plant(m: MixedEngines, seeds: list[int]) -> None:
    for seed in seeds:
        for engine in m.engines.values():
            engine.post("/v1/completions", {**GEN, "prompt": words(seed, PREFIX_WORDS), "max_tokens": 1})


def _extending(seed: int) -> dict[str, Any]:
    return {**GEN, "prompt": words(seed, PREFIX_WORDS) + " " + words(seed + 1, 40), "max_tokens": 1}


def _subscribed(gw: GatewayUnderTest, m: MixedEngines, seed: int) -> None:
    """Until each engine's live events reach the gateway (a ZMQ subscriber misses what is published
    before its connection completes): one-block prompts of their own, straight to the engines."""
    for name, engine in m.engines.items():
        before = gw.events_received(name)
        for attempt in range(30):
            engine.post("/v1/completions", {**GEN, "prompt": words(seed + 50 + attempt, 40), "max_tokens": 1})
            if wait_for(lambda n=name, b=before: gw.events_received(n) > b, 2.0):
                break
        else:
            raise AssertionError(f"no KV event from {name} reached the gateway")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


CANARY_LOG: list[str] = []  # the canary's log lines of the gateway the running test started


@contextmanager
def planted_then_gateway(m: MixedEngines, *, events: bool = True, **kv: Any) -> Iterator[tuple[GatewayUnderTest, int]]:
    """Plant the prefixes, then start a gateway with these kv settings (round robin, so both engines
    serve: the alarm is per instance); yields the gateway and the first prefix seed. The canary's
    log lines from its start-up on are in CANARY_LOG."""
    seed = next(_seeds)
    _plant(m, [seed + i for i in range(REQUESTS + MAX_EXTRA)])
    canary_log, handler = logging.getLogger("conductor.kv.canary"), _Lines()
    old_level = canary_log.level
    canary_log.setLevel(logging.INFO)
    canary_log.addHandler(handler)
    CANARY_LOG.clear()
    try:
        with run_gateway(
            mixed=[{"url": e.url} for e in m.engines.values()], policy="round_robin", block_size=BLOCK_SIZE, kv=kv
        ) as gw:
            CANARY_LOG.extend(handler.lines)  # what start-up logged, before any request
            if events:
                _subscribed(gw, m, seed + 2 * (REQUESTS + MAX_EXTRA))
            yield gw, seed
    finally:
        canary_log.removeHandler(handler)
        canary_log.setLevel(old_level)


def _canary_caught(gw: GatewayUnderTest, result: str, state: str, setting: str) -> None:
    """Before any client request (the gateway's start-up waited for the canaries): both engines'
    canary says `result` in /ready's detail, naming `setting`, with one log line each."""
    assert not gw.observations, "a client request came before the check"
    detail = httpx.get(gw.url + "/ready", timeout=10).json()["kv_canary"]
    for name in ("mixed-0", "mixed-1"):
        got = detail["instances"][name]
        assert (got["state"], got["result"]) == (state, result), (name, got)
        assert setting in got["detail"], (name, got["detail"])
        lines = [line for line in CANARY_LOG if line.startswith(("KV CANARY", "KV canary on")) and f" on {name}" in line]
        assert len(lines) == 1 and (f"[{result}]" in lines[0] or result == "verified"), lines
    assert detail["unverified"] == (2 if state == "failed" else 0), detail
    text = _metrics(gw)
    for name in ("mixed-0", "mixed-1"):
        assert metric_sum(text, "conductor_kv_canary_total", instance=name, result=result) == 1
        print(f"{name}: canary {result} in {detail['instances'][name]['seconds'] * 1000:.0f} ms from the gateway's start")


def _through(gw: GatewayUnderTest, seed: int, n: int) -> list[Observation]:
    return [gw.post("/v1/completions", _extending(seed + i))[1] for i in range(n)]


def _metrics(gw: GatewayUnderTest) -> str:
    return httpx.get(gw.url + "/metrics", timeout=10).text


def _under_alarms(gw: GatewayUnderTest) -> dict[str, set[str]]:
    """Raised coverage (direction under) alarms: instance -> cause tags."""
    text = _metrics(gw)
    alarms: dict[str, set[str]] = {}
    for name in ("mixed-0", "mixed-1"):
        for cause in ("block_size", "hash_seed", "tokenizer", "no_events", "late_start", "unknown"):
            if metric_sum(text, "conductor_kv_hash_alarm", instance=name, direction="under", cause=cause) == 1:
                alarms.setdefault(name, set()).add(cause)
    return alarms


def _expect_alarm(gw: GatewayUnderTest, seed: int, cause: str) -> Mapping[str, set[str]]:
    """Requests through the gateway until both instances' coverage alarms name `cause`."""
    seen = _through(gw, seed, REQUESTS)
    for extra in range(MAX_EXTRA):
        if _under_alarms(gw) == {"mixed-0": {cause}, "mixed-1": {cause}}:
            break
        seen += _through(gw, seed + REQUESTS + extra, 1)
    # the hits were there to be predicted: each engine held the planted prefix
    assert [o.cached_tokens for o in seen] == [PLANTED_TOKENS] * len(seen)
    assert {o.prefill for o in seen} == {"mixed-0", "mixed-1"}
    assert sum(o.predicted_cached_tokens for o in seen) < 0.8 * sum(o.cached_tokens for o in seen)
    text = _metrics(gw)
    assert metric_sum(text, "conductor_kv_hash_coverage") < 0.8
    for name in ("mixed-0", "mixed-1"):
        assert metric_sum(text, "conductor_kv_instance_hash_coverage", instance=name) < 0.8
    alarms = _under_alarms(gw)
    assert alarms == {"mixed-0": {cause}, "mixed-1": {cause}}, alarms
    warned = [w for w in gw.kv_warnings if w.startswith("KV CACHE HITS UNPREDICTED")]
    assert warned, gw.kv_warnings
    assert any(f"Likely cause [{cause}]" in w for w in warned), warned
    return alarms


def test_control_a_gateway_set_up_right_predicts_every_planted_hit(mixed_engines: MixedEngines) -> None:
    with planted_then_gateway(mixed_engines, **_kv_right(mixed_engines)) as (gw, seed):
        _canary_caught(gw, "verified", "verified", "vLLM hashes")
        # the replay sockets gave the late gateway what the engines already held
        keys = gw.keys_of(gw.on_loop(lambda: gw.analyzer.tokenizer.encode_prompt(words(seed, PREFIX_WORDS))))
        assert wait_for(lambda: gw.index_match(keys) == {"mixed-0": 6, "mixed-1": 6}, 20.0), gw.index_match(keys)
        seen = _through(gw, seed, REQUESTS)
        assert [(o.predicted_cached_tokens, o.cached_tokens) for o in seen] == [(PLANTED_TOKENS,) * 2] * REQUESTS
        text = _metrics(gw)
        assert metric_sum(text, "conductor_kv_hash_coverage") == 1.0
        assert metric_sum(text, "conductor_kv_hash_agreement") == 1.0
        assert _under_alarms(gw) == {}
        assert not [w for w in gw.kv_warnings if w.startswith("KV ")], gw.kv_warnings


def test_a_wrong_hash_seed_is_named(mixed_engines: MixedEngines) -> None:
    # the engines run with PYTHONHASHSEED=HASH_SEED; the gateway is told another seed
    kv = _kv_right(mixed_engines, vllm_hash_seed="7")
    with planted_then_gateway(mixed_engines, **kv) as (gw, seed):
        _canary_caught(gw, "hash_seed", "failed", "kv.vllm_hash_seed '7'")
        _expect_alarm(gw, seed, "hash_seed")
        assert any("kv.vllm_hash_seed '7'" in w for w in gw.kv_warnings)


def test_no_kv_events_endpoint_is_named(mixed_engines: MixedEngines) -> None:
    kv = _kv_right(mixed_engines, kv_events={})
    with planted_then_gateway(mixed_engines, events=False, **kv) as (gw, seed):
        # reported, not excluded: the index holds only the gateway's own dispatches, keyed as it keys them
        _canary_caught(gw, "no_events", "unverifiable", "no KV events endpoint is configured")
        _expect_alarm(gw, seed, "no_events")
        assert any("no KV events endpoint is configured" in w for w in gw.kv_warnings)


def test_kv_events_that_never_arrive_are_named(mixed_engines: MixedEngines) -> None:
    # what a worker started without --kv-events-config amounts to: an endpoint nothing publishes on
    silent = {name: {"endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "kv-events"} for name in mixed_engines.engines}
    kv = _kv_right(mixed_engines, kv_events=silent, replay_on_start=False)
    with planted_then_gateway(mixed_engines, events=False, **kv) as (gw, seed):
        _canary_caught(gw, "no_events", "failed", "--kv-events-config")
        _expect_alarm(gw, seed, "no_events")
        assert any("no KV event has arrived" in w for w in gw.kv_warnings)


def test_a_gateway_started_after_the_engines_filled_their_caches_is_named(mixed_engines: MixedEngines) -> None:
    # right in every way but one: it does not ask the replay sockets for what it missed
    kv = _kv_right(mixed_engines, replay_on_start=False)
    with planted_then_gateway(mixed_engines, **kv) as (gw, seed):
        # keyed right, so trusted; told that what the engines cached before is unknown
        _canary_caught(gw, "late_start", "verified", "keep kv.replay_on_start on")
        _expect_alarm(gw, seed, "late_start")


def test_the_builtin_byte_tokenizer_is_named(mixed_engines: MixedEngines) -> None:
    # kv on with the built-in byte tokenizer (the gateway's own keys). Not the default any more: kv.tokenizer
    # "auto" asks the workers' /tokenize (test_the_default_tokenizer_is_the_workers_own below)
    events = _kv_right(mixed_engines)["kv_events"]
    kv = {
        "enabled": True,
        "tokenizer": "builtin",
        "agreement_min_samples": MIN_SAMPLES,
        "events_silence_s": 3600,
        "kv_events": events,
    }
    with planted_then_gateway(mixed_engines, **kv) as (gw, seed):
        _canary_caught(gw, "tokenizer", "failed", "kv.tokenizer 'builtin' is not the model's")
        _expect_alarm(gw, seed, "tokenizer")
        assert any("the built-in byte tokenizer is not the model's" in w for w in gw.kv_warnings)


def test_the_default_tokenizer_is_the_workers_own(mixed_engines: MixedEngines) -> None:
    # kv on, nothing else said: kv.tokenizer "auto" finds the engines' /tokenize, so the planted
    # prefix's hits are predicted where the built-in tokenizer above missed them
    events = _kv_right(mixed_engines)["kv_events"]
    kv = {"enabled": True, "agreement_min_samples": MIN_SAMPLES, "events_silence_s": 3600, "kv_events": events}
    with planted_then_gateway(mixed_engines, canary_timeout_s=10.0, **kv) as (gw, seed):
        _canary_caught(gw, "verified", "verified", "")
        seen = _through(gw, seed, REQUESTS)
        assert [o.cached_tokens for o in seen] == [PLANTED_TOKENS] * len(seen)
        # the built-in tokenizer's run above predicts under 80% of them
        assert sum(o.predicted_cached_tokens for o in seen) >= 0.8 * sum(o.cached_tokens for o in seen), seen
        assert _under_alarms(gw) == {}


def test_a_restarted_engine_leaves_the_index_with_its_first_new_event(mixed_engines: MixedEngines) -> None:
    # last in the module: it restarts one of the package's engines (it is up again when this ends)
    with planted_then_gateway(mixed_engines, **_kv_right(mixed_engines)) as (gw, seed):
        keys = gw.keys_of(gw.on_loop(lambda: gw.analyzer.tokenizer.encode_prompt(words(seed, PREFIX_WORDS))))
        assert wait_for(lambda: gw.index_match(keys) == {"mixed-0": 6, "mixed-1": 6}, 20.0), gw.index_match(keys)
        engine = mixed_engines.engines["mixed-1"]
        (sub,) = [s for s in gw.analyzer.subscribers if s.source.instance == "mixed-1"]
        engine.restart()
        # back up with an empty cache, and nothing has told the gateway yet: still credited
        assert gw.index_match(keys) == {"mixed-0": 6, "mixed-1": 6}
        resyncs, tries = sub.stats.resyncs, count(seed + 200)
        sent_at = [0.0]

        def restart_seen() -> bool:  # a request straight to the engine, until its events come
            sent_at[0] = time.monotonic()
            engine.post("/v1/completions", {**GEN, "prompt": words(next(tries), 40), "max_tokens": 1})
            return wait_for(lambda: sub.stats.resyncs > resyncs, 2.0, interval=0.005)

        assert wait_for(restart_seen, 60.0), "no event of the restarted engine reached the gateway"
        seen_after = time.monotonic() - sent_at[0]
        # the resync dropped the engine's entries before its first new batch was applied
        assert gw.index_match(keys) == {"mixed-0": 6}
        print(f"real engine restart: its entries gone {seen_after * 1000:.0f} ms after the request of its first new event")
        canary = gw.analyzer.canary
        assert canary is not None
        assert wait_for(lambda: canary.states["mixed-1"].settled == 2, 30.0), canary.states["mixed-1"]
        assert canary.states["mixed-1"].state == "verified"  # checked again, and trusted again
