"""What an analyzer may offer beside the PromptAnalyzer protocol, found by typed Protocols checked
once at wiring (conductor/kv/analysis.py, canary.py, agreement.py), not by attribute names: the
prompt bound the gateway hands over, the tokenizer's vocabulary (read per request, since kv.tokenizer
auto chooses its tokenizer on first use), the KV canary (which carries the upstream key) and the hash
agreement. The canary and auto tokenizer run against a stand-in worker on real sockets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from adapters.auto_tokenizer import AutoTokenizer
from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.tokenizers import LocalTokenizer, WorkerTokenizer
from conductor.config.settings import load_settings
from conductor.core.block_keys import XxhashKeys
from conductor.core.tokenization import ByteTokenizer
from conductor.core.types import Decision, Observation, Role
from conductor.gateway import Gateway
from conductor.kv.agreement import agreement_of
from conductor.kv.analysis import (
    EstimatingAnalyzer,
    PromptAnalysis,
    RequestKind,
    bind_prompt_bound,
    vocab_size_of,
    vocabulary_of,
)
from conductor.kv.analyzer import HashAgreement, KVAwareAnalyzer, build_analyzer
from conductor.kv.canary_access import canary_detail, canary_of
from conductor.kv.prompt_bounds import PromptBound
from tests.support.ports import free_port
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn

UPSTREAM_KEY = "sk-upstream-canary"


class PlainAnalyzer:
    """An analyzer of another project: the PromptAnalyzer methods and nothing else."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def analyse(self, kind: RequestKind, body: Mapping[str, Any]) -> PromptAnalysis:
        return PromptAnalysis(prompt_tokens=1, exact=False)

    async def on_dispatch(self, analysis: PromptAnalysis, decision: Decision) -> None:
        return None

    def on_result(self, analysis: PromptAnalysis, decision: Decision, observation: Observation) -> None:
        return None


class SizedAnalyzer(PlainAnalyzer):
    """One that offers its vocabulary the typed way (KnowsVocabulary)."""

    def vocab_size(self) -> int | None:
        return 1000


def _kv_analyzer(tokenizer: Any) -> KVAwareAnalyzer:
    scheme = XxhashKeys(16)
    index = MemoryIndex()
    agreement = HashAgreement(CollectorRegistry())
    return KVAwareAnalyzer(
        tokenizer=tokenizer, scheme=scheme, index=index, feeder=IndexFeeder(index, scheme, translate=True), agreement=agreement
    )


def test_an_analyzer_offers_only_what_it_declares() -> None:
    builtin = _kv_analyzer(LocalTokenizer(ByteTokenizer()))
    assert vocab_size_of(builtin) == vocabulary_of(builtin)() == ByteTokenizer.vocab_size
    assert vocab_size_of(_kv_analyzer(WorkerTokenizer("http://127.0.0.1:1"))) is None  # the worker checks ids itself
    assert agreement_of(builtin) is builtin.agreement and canary_of(builtin) is None
    assert vocab_size_of(SizedAnalyzer()) == vocabulary_of(SizedAnalyzer())() == 1000
    for other in (EstimatingAnalyzer(), PlainAnalyzer()):
        assert vocab_size_of(other) is None and vocabulary_of(other)() is None
        assert agreement_of(other) is None and canary_of(other) is None and canary_detail(other) is None


def test_the_gateway_bound_reaches_analyzers_that_bound_prompts_only() -> None:
    bound = PromptBound(100, lambda _: 50)
    estimating, kv = EstimatingAnalyzer(), _kv_analyzer(LocalTokenizer(ByteTokenizer()))
    plain = PlainAnalyzer()
    for analyzer in (estimating, kv, plain):
        bind_prompt_bound(analyzer, bound)
    assert estimating.prompt_bound is bound and kv.prompt_bound is bound
    assert not hasattr(plain, "prompt_bound")


async def test_the_vocabulary_resolved_at_wiring_follows_the_auto_tokenizers_later_choice() -> None:
    """kv.tokenizer auto knows no vocabulary until a worker answered /tokenize (this one has no
    route: the byte tokenizer); what the endpoint resolved before that must tell it after."""
    with serve(StandIn(model="tiny")) as worker:
        analyzer = build_analyzer({"tokenizer": "auto", "canary": False}, [("m0", Role.MIXED, worker.url)])
        assert isinstance(analyzer, KVAwareAnalyzer) and isinstance(analyzer.tokenizer, AutoTokenizer)
        read = vocabulary_of(analyzer)  # as the endpoint keeps it, before any request
        try:
            assert read() is None
            analysis = await analyzer.analyse("completions", {"model": "tiny", "prompt": "hello vocabulary"})
            assert analysis.exact and analyzer.tokenizer.source == "builtin"
            assert read() == vocab_size_of(analyzer) == ByteTokenizer.vocab_size
        finally:
            await analyzer.close()


def test_the_kv_canary_carries_the_upstream_key_and_reports_on_ready() -> None:
    """The canary is found on the analyzer by its Protocol: its requests to the worker carry the
    upstream key (conductor/fleet/membership.py), and /ready shows its verdict (no events come)."""
    worker = StandIn(model="tiny")
    instance = {"url": "", "name": "m0", "kv_events_endpoint": f"tcp://*:{free_port()}"}
    with serve(worker) as w:
        instance["url"] = w.url
        overrides: dict[str, Any] = {
            "mixed": [instance],
            "auth": {"upstream_api_key": UPSTREAM_KEY},
            "logs": {"level": "error"},
            "kv": {"enabled": True, "tokenizer": "builtin", "canary_timeout_s": 0.5, "canary_attempts": 1},
        }
        gateway = Gateway(load_settings(environ={}, overrides=overrides))
        with serve_gateway(gateway) as server:
            canaries = [r for r in worker.requests if r.path.endswith("/completions")]
            assert canaries, "the canary sent nothing"
            assert all(r.headers.get("authorization") == f"Bearer {UPSTREAM_KEY}" for r in canaries)
            ready = httpx.get(server.url + "/ready", timeout=10).json()
    detail = ready["kv_canary"]
    assert detail["instances"]["m0"]["result"] == "no_events" and detail["unverified"] == 1
