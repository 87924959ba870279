"""Session affinity through the real gateway (real sockets, stand-in P/D workers over HTTP, kvcache_aware):
an agent's parallel calls of one session land on one prefill instance, where without the session tag the
policy spreads them over the queues; a bad session key is a 400 before anything is forwarded."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from policies.kvcache_aware import KvCacheAwarePolicy
from tests.support.cluster import Cluster, cluster
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

# no KV index: the gateway sees no prefix, so only the session can say where the calls belong
SETTINGS: dict[str, Any] = {"kv": {"enabled": False, "tokenizer": "builtin"}, "slo": {"ttft_s": 5.0}}


def _post(url: str, prompt: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": 2, **body}
    return httpx.post(url + "/v1/completions", json=payload, headers=headers or {}, timeout=60)


def _prefills_of(c: Cluster) -> list[int]:
    return [len(w.bodies()) for w in c.prefills]


def _parallel_calls(tagged: dict[str, Any]) -> list[int]:
    """Three calls of one agent step, each sent while the ones before wait in their prefill (the
    prefills answer only once released): how many landed on each prefill instance."""
    hold = threading.Event()
    # predictions taken as given (no learning): a learning policy keeps its TTFT slack, which the
    # session's hint acts through, off until its first refit on the fleet's legs (placement.py)
    policy = KvCacheAwarePolicy(online=False)
    with cluster("nixl", n_prefill=2, n_decode=1, policy=policy, standin={"prefill": {"answer_after": hold}}, **SETTINGS) as c:
        futures: list[Future[httpx.Response]] = []
        with ThreadPoolExecutor(3) as pool:
            try:
                for n in range(3):
                    prompt = f"tool call {n}: " + "look this up " * (20 + 7 * n)
                    futures.append(pool.submit(_post, c.url, prompt, **tagged))
                    assert wait_for(lambda n=n: sum(_prefills_of(c)) == n + 1)  # dispatched, held there
            finally:
                hold.set()
            assert [f.result().status_code for f in futures] == [200, 200, 200]
        return _prefills_of(c)


def test_an_agents_parallel_calls_land_on_one_instance_only_with_the_session_tag() -> None:
    assert sorted(_parallel_calls({"headers": {"x-session-id": "agent-run-1"}})) == [0, 3]
    assert sorted(_parallel_calls({"prompt_cache_key": "agent-run-1"})) == [0, 3]  # OpenAI's field, the same
    assert sorted(_parallel_calls({})) != [0, 3]  # untagged, the second call goes where no queue waits


def test_a_bad_session_key_is_a_400_and_nothing_is_forwarded() -> None:
    with cluster("nixl", n_prefill=1, n_decode=1, policy=KvCacheAwarePolicy(), **SETTINGS) as c:
        for headers, body, param in (
            ({}, {"prompt_cache_key": 7}, "prompt_cache_key"),
            ({}, {"user": "u" * 300}, "user"),
            ({"x-session-id": "s" * 300}, {}, "x-session-id"),
        ):
            r = _post(c.url, "hello there", headers, **body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
        assert not c.prefills[0].requests
        ok = _post(c.url, "hello there", {}, prompt_cache_key="conv-1", user="alice")
        assert ok.status_code == 200
        assert c.prefills[0].bodies()[0]["prompt_cache_key"] == "conv-1"  # passed on: vLLM ignores it
