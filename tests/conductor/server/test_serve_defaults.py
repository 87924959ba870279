"""What `conductor serve --prefill URL --decode URL` does with no other flag: Conductor's own policy
(kvcache_aware) with the KV index on, prompts tokenized by the workers' own /tokenize (the built-in
byte tokenizer, with a warning, where they serve none), the index fed by the gateway's dispatches
when no instance has a KV events endpoint. Round robin without the index stays a flag away. The
workers are emulated vLLM processes (and a stand-in without /tokenize) on real sockets."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from adapters.auto_tokenizer import AutoTokenizer
from conductor.cli import add_serve_args, settings_from_args
from conductor.config.settings import Settings
from conductor.gateway import Gateway
from conductor.kv.analysis import EstimatingAnalyzer
from conductor.kv.analyzer import KVAwareAnalyzer
from tests.support.emulator import Emulator, start_emulator
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn

pytestmark = pytest.mark.timeout(300)  # three worker subprocesses on a busy box: a bound, not a speed check
PROMPT = "Every turn of this conversation starts with the same long system prompt. " * 40  # ~2900 byte tokens


def _settings(*argv: str) -> Settings:
    """The settings `conductor serve ARGV` runs with (no config file, no CONDUCTOR_* variables)."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    settings: Settings = settings_from_args(parser.parse_args(argv))
    return settings


@pytest.fixture(autouse=True)
def _no_conductor_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.upper().startswith("CONDUCTOR_")]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def pd_workers() -> Iterator[tuple[Emulator, Emulator, Emulator]]:
    with ExitStack() as stack:
        prefills = [stack.enter_context(start_emulator("prefill", "nixl", time_scale=0.01, model="tiny")) for _ in range(2)]
        decode = stack.enter_context(start_emulator("decode", "nixl", time_scale=0.01, model="tiny"))
        yield prefills[0], prefills[1], decode


@contextmanager
def _served(settings: Settings) -> Iterator[tuple[str, Gateway]]:
    gateway = Gateway(settings)
    with serve_gateway(gateway) as server:
        yield server.url, gateway


def _prefill_counts(*prefills: Emulator) -> list[int]:
    """How many requests each emulated prefill has received since its last reset."""
    return [len(httpx.get(p.url + "/emulator/requests", timeout=30).json()) for p in prefills]


def _send_same_prompt(url: str, times: int) -> None:
    for _ in range(times):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text


def _reset(*workers: Emulator) -> None:
    for w in workers:
        httpx.post(w.url + "/emulator/reset", timeout=30).raise_for_status()


def test_the_defaults_are_the_products_own_scheduling_for_flags_and_yaml_alike(tmp_path: Path) -> None:
    for settings in (_settings("--prefill", "http://p:1", "--decode", "http://d:2"), Settings()):
        assert settings.policy == "kvcache_aware"
        assert settings.kv.enabled and settings.kv.tokenizer == "auto" and settings.kv.index == "memory"
    config = tmp_path / "conductor.yaml"
    config.write_text("mixed: [http://m:1]\n")  # a YAML user who names nothing gets the same
    from_yaml = _settings("--config", str(config))
    assert from_yaml.policy == "kvcache_aware" and from_yaml.kv.enabled and from_yaml.kv.tokenizer == "auto"


def test_round_robin_without_the_index_stays_reachable(tmp_path: Path) -> None:
    flags = _settings("--mixed", "http://m:1", "--policy", "round_robin", "--no-kv")
    config = tmp_path / "conductor.yaml"
    config.write_text("mixed: [http://m:1]\npolicy: round_robin\nkv: {enabled: false}\n")
    for settings in (flags, _settings("--config", str(config))):
        gateway = Gateway(settings)
        assert gateway.policy.name == "round_robin" and isinstance(gateway.analyzer, EstimatingAnalyzer)
    assert _settings("--config", str(config), "--kv").kv.enabled  # a flag still overrides the file


def test_serve_with_only_instances_routes_a_repeated_prompt_to_the_prefill_that_cached_it(
    pd_workers: tuple[Emulator, Emulator, Emulator],
) -> None:
    p0, p1, d = pd_workers
    _reset(p0, p1, d)
    with _served(_settings("--prefill", p0.url, "--prefill", p1.url, "--decode", d.url)) as (url, gateway):
        assert gateway.policy.name == "kvcache_aware" and isinstance(gateway.analyzer, KVAwareAnalyzer)
        _send_same_prompt(url, 3)
        tokenizer = gateway.analyzer.tokenizer
        assert isinstance(tokenizer, AutoTokenizer) and tokenizer.source in (p0.url, p1.url)  # the workers' /tokenize
        # no KV events configured: the gateway's own dispatch records say where the prefix is cached
        assert sorted(_prefill_counts(p0, p1)) == [0, 3]


def test_the_same_prompts_under_round_robin_go_to_both_prefills(pd_workers: tuple[Emulator, Emulator, Emulator]) -> None:
    # the counterpart of the test above: without the default the repeated prompt is not kept together
    p0, p1, d = pd_workers
    _reset(p0, p1, d)
    settings = _settings("--prefill", p0.url, "--prefill", p1.url, "--decode", d.url, "--policy", "round_robin", "--no-kv")
    with _served(settings) as (url, _):
        _send_same_prompt(url, 3)
        assert sorted(_prefill_counts(p0, p1)) == [1, 2]


def test_workers_without_tokenize_fall_back_to_the_builtin_tokenizer_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    worker = StandIn(model="tiny")  # answers /tokenize with 404, as an engine without the route
    with serve(worker) as w, _served(_settings("--mixed", w.url)) as (url, gateway):
        with caplog.at_level(logging.WARNING, logger="adapters.auto_tokenizer"):
            _send_same_prompt(url, 2)
        tokenizer = gateway.analyzer.tokenizer
        assert isinstance(tokenizer, AutoTokenizer) and tokenizer.source == "builtin"
        warned = [r.getMessage() for r in caplog.records if r.name == "adapters.auto_tokenizer"]
        assert len(warned) == 1 and "falling back to the built-in byte tokenizer" in warned[0] and w.url in warned[0]
        assert len(worker.bodies()) == 2  # both requests served; /tokenize is no completion
