"""Three gateway replicas in front of the same workers, sharing in-flight load and the KV index
through a real Redis.

A burst of prompts sent one per replica, each sent once the replicas could know of the one
before, must spread over the idle prefill instances. Without load sharing every replica sees the
cluster idle and all three land on the same instance: that over-commit is asserted too, so the
test proves the sharing is what spreads them. Then a prompt dispatched through one replica is sent
again through another, which never saw it: the shared index routes it to the instance holding it.

The prefill workers hold every request (they answer only when the client leaves), so the queues
the replicas see stay put while the test looks; closing the client sockets ends the requests.
"""

from __future__ import annotations

import json
import random
import socket
import string
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
import redis

from conductor.config.settings import load_settings
from conductor.core.types import Role
from conductor.gateway import Gateway
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

N_PREFILL = 3
REPLICAS = 3


@dataclass
class Deployment:
    run: str
    prefills: list[StandIn]
    gateways: list[tuple[str, Gateway]]

    def prefill_name(self, i: int) -> str:
        return f"p{i}-{self.run}"


@contextmanager
def deployment(load_share: str) -> Iterator[Deployment]:
    """Stand-in workers and three replicas. Instance names, replica ids and the index prefix are
    unique to the run: the Redis (and the load-share key space) is shared with other tests."""
    redis.Redis().ping()
    run = uuid.uuid4().hex[:8]
    with ExitStack() as stack:
        prefills = [StandIn(role="prefill", hang=True, engine_id=f"engine-p{i}") for i in range(N_PREFILL)]
        p_specs = [{"url": stack.enter_context(serve(p)).url, "name": f"p{i}-{run}"} for i, p in enumerate(prefills)]
        d_url = stack.enter_context(serve(StandIn(role="decode"))).url
        gateways = []
        for r in range(REPLICAS):
            settings = load_settings(
                environ={},
                overrides={
                    "prefill": p_specs,
                    "decode": [{"url": d_url, "name": f"d0-{run}"}],
                    "policy": "kvcache_aware",
                    "load_share": {
                        "mode": load_share,
                        "replica_id": f"test3-{run}-{r}",
                        "sync_interval_s": 0.05,
                        "timeout_s": 5.0,
                    },
                    "health": {"interval_s": 0.5},
                    # the 250K-token prompts below are past the default bound (131072 where no worker
                    # reports a context length); the stand-in workers take any length
                    "limits": {"max_prompt_tokens": 300_000},
                    "kv": {
                        "enabled": True,
                        "tokenizer": "builtin",
                        "index": "redis",
                        "redis_prefix": f"test:three-replicas:{run}:kv:",
                        "redis_timeout_s": 5.0,
                        "redis_write_timeout_s": 5.0,
                    },
                },
            )
            gw = Gateway(settings)
            # a short grace period: the held requests are ended by closing their sockets first
            gateways.append((stack.enter_context(serve_gateway(gw, timeout_graceful_shutdown=5)).url, gw))
        assert wait_for(lambda: all(g.registry.healthy_count(Role.PREFILL) == N_PREFILL for _, g in gateways), timeout=30)
        yield Deployment(run, prefills, gateways)
        with redis.Redis() as client:
            keys = list(client.scan_iter(match=f"test:three-replicas:{run}:*", count=1000))
            if keys:
                client.delete(*keys)


def open_request(url: str, prompt: str) -> socket.socket:
    """Send a completion and keep the connection open: the request lives until the socket closes."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return sock


def queued_prefills(gw: Gateway) -> int:
    """Prefills this replica sees queued anywhere: its own plus, with sharing, the others'."""
    return sum(len(i.prefill_queue) for i in gw.registry.snapshot().instances if i.role is Role.PREFILL)


def received(d: Deployment) -> list[int]:
    return [len(p.bodies()) for p in d.prefills]


def prompt(seed: int) -> str:
    """A prompt the policy predicts ~8 s of prefill for (250K byte tokens): a held prefill counts
    as queued only until its predicted end, and the burst must come well within that."""
    return "".join(random.Random(seed).choices(string.ascii_letters, k=250_000))


def send_burst(d: Deployment, prompts: list[str], *, wait_for_sharing: bool) -> list[socket.socket]:
    """One prompt per replica, in turn. Each is sent once its predecessor reached a worker and,
    with sharing, once every replica sees it queued: the replicas could know, so they must."""
    socks = []
    for k, text in enumerate(prompts):
        url, _ = d.gateways[k % REPLICAS]
        socks.append(open_request(url, text))
        sent = k + 1

        def reached_a_worker(sent: int = sent) -> bool:
            return sum(received(d)) == sent

        def every_replica_sees_it(sent: int = sent) -> bool:
            return all(queued_prefills(g) == sent for _, g in d.gateways)

        assert wait_for(reached_a_worker, timeout=30), received(d)
        if wait_for_sharing:
            assert wait_for(every_replica_sees_it, timeout=30), [queued_prefills(g) for _, g in d.gateways]
    return socks


def close_all(d: Deployment, socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    # the replicas notice the clients left, cancel the held prefills and stop counting them
    assert wait_for(lambda: all(queued_prefills(g) == 0 for _, g in d.gateways), timeout=30)


@pytest.mark.parametrize("load_share", ["redis", "none"])
def test_burst_through_three_replicas_spreads_only_with_sharing(load_share: str) -> None:
    with deployment(load_share) as d:
        socks = send_burst(d, [prompt(k) for k in range(REPLICAS)], wait_for_sharing=load_share == "redis")
        try:
            if load_share == "redis":
                assert received(d) == [1, 1, 1]  # one per idle instance
            else:
                # every replica saw an idle cluster and picked the same instance: the over-commit
                assert sorted(received(d)) == [0, 0, 3]
        finally:
            close_all(d, socks)


def test_prefix_dispatched_through_one_replica_is_routed_there_by_another() -> None:
    with deployment("redis") as d:
        prompts = [prompt(100 + k) for k in range(REPLICAS)]
        socks = send_burst(d, prompts, wait_for_sharing=True)
        assert received(d) == [1, 1, 1]
        holder = next(i for i, p in enumerate(d.prefills) if p.bodies() and p.bodies()[0]["prompt"] == prompts[-1])
        assert holder != 0  # an idle cluster's first pick: landing there would prove nothing
        close_all(d, socks)

        # replica 0 never saw the last prompt (replica 2 sent it); the shared index knows where it went
        url, _ = d.gateways[0]
        sock = open_request(url, prompts[-1] + " and one more question")
        try:
            assert wait_for(lambda: sum(received(d)) == REPLICAS + 1, timeout=30), received(d)
            assert len(d.prefills[holder].bodies()) == 2, received(d)
        finally:
            close_all(d, [sock])
