"""The gateway in-process, in front of real engines, with what the tests need to see inside it.

The gateway runs on a real uvicorn server in this (the main venv's) process, built from settings as
`conductor serve` builds it. Two read-only windows into it:
- every `Observation` it makes when a request finishes (worker-reported vs index-predicted cached
  tokens, the instance that served it), recorded by wrapping `Router.observe`;
- its KV index, read on the gateway's own event loop (the index is not thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from adapters.index.memory import MemoryIndex
from conductor.config.settings import load_settings, merge_settings
from conductor.core.types import Observation
from conductor.gateway import Gateway
from conductor.kv.analyzer import KVAwareAnalyzer
from conductor.kv.canary_access import canary_detail
from tests.support.servers import ServerThread, serve_gateway
from tests.support.waiting import wait_for

T = TypeVar("T")


@dataclass
class GatewayUnderTest:
    url: str
    gateway: Gateway
    server: ServerThread
    observations: list[Observation] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)  # the conductor.decisions log lines
    kv_warnings: list[str] = field(default_factory=list)  # warnings of the KV index (conductor.kv.analyzer)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def analyzer(self) -> KVAwareAnalyzer:
        analyzer = self.gateway.analyzer
        assert isinstance(analyzer, KVAwareAnalyzer), type(analyzer)
        return analyzer

    def on_loop(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 60) -> T:
        """Run a coroutine on the gateway's event loop and wait for its result."""
        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(make(), self.server.loop).result(timeout)

    def confirmed_keys(self, instance: str) -> set[int]:
        """Block keys the index holds for `instance` on the word of KV events (dispatch guesses left out)."""
        index = self.analyzer.index
        assert isinstance(index, MemoryIndex), type(index)

        async def read() -> set[int]:
            return {key for key, _ in index.confirmed_snapshot(instance)}

        return self.on_loop(read)

    def index_match(self, keys: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `keys` each instance holds, as the index answers a request's look-up."""
        index = self.analyzer.index

        async def read() -> dict[str, int]:
            return dict((await index.match(list(keys))).blocks)

        return self.on_loop(read)

    def keys_of(self, token_ids: Sequence[int]) -> list[int]:
        """The gateway's block keys for these token ids (vLLM's event hashes in key_mode vllm)."""
        return self.analyzer.scheme.keys(list(token_ids))

    def canary_report(self) -> dict[str, Any] | None:
        """The KV canary's report (/ready's kv_canary detail), read on the gateway's loop."""

        async def read() -> dict[str, Any] | None:
            return canary_detail(self.gateway.analyzer)

        return self.on_loop(read)

    def until_verified(self, timeout_s: float = 300.0) -> None:
        """Until the KV canary has verified every instance: one still pending (or failed) is left out
        of the prompt analysis, so its blocks are neither a hit nor a pull source. On a saturated box
        the first canary request can time out (CI: ReadTimeout on both prefills of
        test_pd_readback.py, whose holder was then no pull source); it is sent again within 30 s."""

        def verified() -> bool:
            report = self.canary_report()
            return report is not None and report["unverified"] == 0 and bool(report["instances"])

        assert wait_for(verified, timeout_s), self.canary_report()

    def events_received(self, instance: str) -> int:
        return sum(s.stats.batches for s in self.analyzer.subscribers if s.source.instance == instance)

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 120) -> tuple[dict[str, Any], Observation]:
        """One request through the gateway: its answer and the gateway's observation of it."""
        seen = len(self.observations)
        r = httpx.post(self.url + path, json=dict(body), timeout=timeout)
        assert r.status_code == 200, f"gateway {path}: {r.status_code} {r.text[:500]}"
        return r.json(), self.observation_after(seen)

    def stream(self, path: str, body: Mapping[str, Any], timeout: float = 120) -> tuple[str, Observation]:
        seen = len(self.observations)
        with httpx.stream("POST", self.url + path, json=dict(body), timeout=timeout) as r:
            assert r.status_code == 200, f"gateway {path}: {r.status_code} {r.read()[:500]!r}"
            assert r.headers["content-type"].startswith("text/event-stream"), r.headers
            raw = r.read().decode()
        return raw, self.observation_after(seen)

    def observation_after(self, seen: int, timeout: float = 10) -> Observation:
        """The first observation recorded after `seen` were (the gateway observes once the last
        byte is sent, so it may trail the response by a moment)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.observations) > seen:
                    return self.observations[seen]
            time.sleep(0.01)
        raise AssertionError("the gateway recorded no observation for the request")


class _LogLines(logging.Handler):
    def __init__(self, sink: list[str], level: int) -> None:
        super().__init__(level)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


@contextmanager
def run_gateway(policy: Any = None, **overrides: Any) -> Iterator[GatewayUnderTest]:
    """`policy`: a policy's name (the settings' `policy`) or a policy object (a scripted choice)."""
    if isinstance(policy, str):
        overrides["policy"], policy = policy, None
    # health probes every second, but patient ones: on a machine whose cores are saturated (four
    # engines and the tests on two cores) an engine's /health can take seconds to answer, and
    # these tests are not about ejecting engines (nor connect timeouts)
    settings = load_settings(
        environ={},
        overrides=merge_settings(
            {"health": {"interval_s": 1.0, "timeout_s": 15.0, "unhealthy_after": 4}, "timeouts": {"connect_s": 30.0}}, overrides
        ),
    )
    gateway = Gateway(settings, policy=policy)
    with serve_gateway(gateway) as server:  # yielded once ready: every engine answered a probe
        gut = GatewayUnderTest(url=server.url, gateway=gateway, server=server)
        original = gateway.router.observe

        def observe(routed: Any, observation: Observation) -> None:
            original(routed, observation)
            with gut._lock:
                gut.observations.append(observation)

        gateway.router.observe = observe  # type: ignore[method-assign]
        decisions = logging.getLogger("conductor.decisions")
        handler = _LogLines(gut.decisions, logging.INFO)
        old_level = decisions.level
        decisions.setLevel(logging.INFO)
        decisions.addHandler(handler)
        kv_log = logging.getLogger("conductor.kv")
        kv_handler = _LogLines(gut.kv_warnings, logging.WARNING)
        kv_log.addHandler(kv_handler)
        try:
            yield gut
        finally:
            kv_log.removeHandler(kv_handler)
            decisions.removeHandler(handler)
            decisions.setLevel(old_level)
