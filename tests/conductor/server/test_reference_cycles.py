"""A served request leaves nothing for the cyclic garbage collector: everything it made is freed by
reference counting when it ends. A reference cycle per request (the server's scope holding its
exchange's bound methods did) makes the collector run every few dozen requests, and each of its
passes walks the gateway's long-lived objects: about 5% of the gateway's CPU at concurrency 64
(benchmarks/profile_gateway.py). Counted here with the collector's own bookkeeping on real sockets."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import httpx
import pytest

from policies.registry import load_policy
from tests.support.cluster import cluster

REQUESTS = 40
# the gateway's own modules: the stand-in workers (tests.support) and the client run in this
# process too, and what they leave is not the gateway's
GATEWAY_MODULES = ("conductor.", "adapters.", "policies.", "predictors.")


@pytest.fixture
def saved_garbage() -> Iterator[list[object]]:
    """gc.garbage keeps what the collector found unreachable (instead of freeing it)."""
    gc.collect()
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.garbage.clear()
    try:
        yield gc.garbage
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()


def _gateway_objects(garbage: list[object]) -> list[str]:
    return [type(o).__qualname__ for o in garbage if type(o).__module__.startswith(GATEWAY_MODULES)]


@pytest.mark.parametrize(
    ("protocol", "shape", "settings"),
    [
        ("nixl", {"n_prefill": 0, "n_decode": 0, "n_mixed": 2}, {}),
        ("nixl", {}, {}),
        ("nixl", {}, {"policy": load_policy("kvcache_aware"), "kv": {"enabled": True}}),
    ],
    ids=["mixed", "nixl", "nixl-kvcache-aware"],
)
def test_requests_leave_no_reference_cycles_behind(
    saved_garbage: list[object], protocol: str, shape: dict[str, int], settings: dict[str, object]
) -> None:
    with cluster(protocol, **shape, **settings) as c, httpx.Client(base_url=c.url, timeout=30) as client:
        body = {"model": "tiny", "prompt": "count the cycles " * 8, "max_tokens": 4}
        client.post("/v1/completions", json=body).raise_for_status()  # first use: pools, lazy caches
        gc.collect()
        saved_garbage.clear()
        for i in range(REQUESTS):
            if i % 2:
                client.post("/v1/completions", json=body).raise_for_status()
            else:
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as answer:
                    answer.raise_for_status()
                    answer.read()
        gc.collect()
        left = _gateway_objects(saved_garbage)
    # a cycle per request leaves at least one of the gateway's objects per request; a health probe
    # or a background task may leave a few
    assert len(left) < REQUESTS // 4, sorted(set(left))
