"""`conductor indexer` end to end: real uvicorn servers on sockets, fed by real ZMQ KV events (emulated
vLLM workers, or a vLLM-format publisher below that can drop a batch), answering Mooncake RFC 1403
look-ups; and gateway replicas that read it through `IndexerClient` instead of ingesting events."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from adapters.emulator.kv_events import END_SEQ, block_stored
from adapters.index.remote import IndexerClient
from conductor.config.settings import Settings, load_settings
from conductor.core.block_keys import XxhashKeys
from conductor.gateway import Gateway
from conductor.indexer.api import QueryLimits, create_indexer_app
from conductor.indexer.service import IndexerService
from conductor.kv.analyzer import KVAwareAnalyzer
from tests.support.emulator import Emulator, free_port, start_emulator
from tests.support.servers import serve, serve_gateway
from tests.support.waiting import wait_for

BS = 16


class VllmPublisher:
    """A worker's KV event sockets as vLLM has them: PUB [topic, seq, payload] with the payload
    [ts, events, dp_rank] msgpack-encoded from the emulator's event maps, and a ROUTER replay socket
    answering from a buffer. `publish(..., drop=True)` buffers a batch without sending it: a lost
    message the subscriber has to repair from the replay socket."""

    def __init__(self, port: int | None = None, replay_port: int | None = None, rank: int = 0) -> None:
        self.port, self.replay_port = port or free_port(), replay_port or free_port()
        self.rank = rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        # Both sockets bind here, on the caller's thread, so a port taken meanwhile raises ZMQError to
        # the caller (which picks others) instead of killing the replay thread and leaving a socket
        # open that makes term() wait for ever. The thread only uses the bound ROUTER afterwards.
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(f"tcp://127.0.0.1:{self.port}")
            self._router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=1000)
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()
        self.encode = msgspec.msgpack.Encoder().encode

    @property
    def instance(self) -> dict[str, Any]:
        """As the worker would be configured: it binds (tcp://*), the indexer connects."""
        return {
            "url": f"http://127.0.0.1:{free_port()}",
            "kv_events_endpoint": f"tcp://*:{self.port}",
            "kv_events_replay_endpoint": f"tcp://*:{self.replay_port}",
        }

    def publish(self, events: list[dict[str, Any]], *, drop: bool = False) -> int:
        payload = self.encode([time.time(), events, self.rank])
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        if not drop:
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        router = self._router
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            with self._lock:
                run = [(s, p) for s, p in self._buffer if s >= int.from_bytes(start, "big")]
            for seq, payload in run:
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", END_SEQ, b""])
        router.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)


@contextmanager
def publishers(n: int) -> Iterator[list[VllmPublisher]]:
    pubs = [VllmPublisher() for _ in range(n)]
    try:
        yield pubs
    finally:
        for p in pubs:
            p.close()


def indexer_settings(instances: list[dict[str, Any]], **extra: Any) -> Settings:
    return load_settings(environ={}, overrides={"mixed": instances, "block_size": BS, **extra})


@contextmanager
def running_indexer(settings: Settings, limits: QueryLimits | None = None) -> Iterator[tuple[str, IndexerService]]:
    service = IndexerService(settings)
    with serve(create_indexer_app(service, limits or QueryLimits())) as server:
        yield server.url, service


def worker(emu: Emulator) -> dict[str, Any]:
    """An emulator as the config file names it (tcp://*:PORT, as the worker was started: it binds)."""
    assert emu.kv_events_endpoint is not None and emu.kv_events_replay_endpoint is not None
    return {
        "url": emu.url,
        "kv_events_endpoint": "tcp://*:" + emu.kv_events_endpoint.rsplit(":", 1)[1],
        "kv_events_replay_endpoint": "tcp://*:" + emu.kv_events_replay_endpoint.rsplit(":", 1)[1],
    }


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return block_stored(hashes, parent, tokens, BS)


def query(url: str, tokens: list[int], **extra: Any) -> httpx.Response:
    return httpx.post(url + "/query", json={"model": "m", "block_size": BS, "token_ids": tokens, **extra}, timeout=10)


def longest(url: str, tokens: list[int], instance: str) -> int:
    r = query(url, tokens)
    assert r.status_code == 200, r.text
    return int(r.json()["default"][instance]["longest_matched"])


def warm_up(pub: VllmPublisher, service: IndexerService) -> None:
    """Publish harmless batches until the subscriber gets one (a SUB misses what is sent before it
    has connected), so that what follows is seen in sequence."""

    def received() -> bool:
        pub.publish([{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}])
        return all(sub.stats.batches > 0 for sub in service.subscribers if sub.source.rank == pub.rank)

    assert wait_for(received, timeout=20, interval=0.1)


def test_query_and_query_by_hash_answer_what_each_worker_holds() -> None:
    rng = random.Random(1)
    a = [rng.randrange(1, 250) for _ in range(20 * BS)]
    b = [rng.randrange(1, 250) for _ in range(12 * BS + 5)]  # a partial tail block: not cached
    with ExitStack() as stack:
        emus = [
            stack.enter_context(
                start_emulator("mixed", kv_events=True, kv_events_replay=True, time_scale=0.05, model="tiny", block_size=BS)
            )
            for _ in range(2)
        ]
        settings = indexer_settings([worker(e) for e in emus])
        url, _ = stack.enter_context(running_indexer(settings))
        for emu, prompt in ((emus[0], a), (emus[1], b)):
            r = httpx.post(emu.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text
        assert wait_for(lambda: longest(url, a, "mixed-0") == 20 * BS and longest(url, b, "mixed-1") == 12 * BS, timeout=20)
        answer = query(url, a + [7] * 40).json()
        assert answer == {
            "default": {
                "mixed-0": {"longest_matched": 320, "GPU": 320, "CPU": 0, "DISK": 0, "DP": {"0": 320}},
                "mixed-1": {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}},
            }
        }
        # a prompt sharing a's first 5 blocks only
        assert longest(url, a[: 5 * BS] + [9] * (3 * BS), "mixed-0") == 5 * BS
        # by hash: the gateway's own block keys; the older field name too; one instance asked for
        keys = XxhashKeys(BS).keys(b)
        r = httpx.post(url + "/query_by_hash", json={"model": "m", "block_size": BS, "seq_hashes": keys})
        assert r.json()["default"]["mixed-1"]["longest_matched"] == 12 * BS
        assert r.json()["default"]["mixed-0"]["longest_matched"] == 0
        # the extension gateways use: only the holders
        r = httpx.post(url + "/query_by_hash", json={"model": "m", "block_size": BS, "seq_hashes": keys, "holders_only": True})
        assert list(r.json()["default"]) == ["mixed-1"]
        r = httpx.post(
            url + "/query_by_hash", json={"model": "m", "block_size": BS, "block_hash": keys[:3], "instance_id": "mixed-1"}
        )
        assert r.json() == {"default": {"mixed-1": {"longest_matched": 48, "GPU": 48, "CPU": 0, "DISK": 0, "DP": {"0": 48}}}}
        metrics = httpx.get(url + "/metrics").text
        assert 'conductor_indexer_lookups_total{outcome="ok",route="query"}' in metrics
        assert "conductor_indexer_lookup_seconds_bucket" in metrics
        held = next(line for line in metrics.splitlines() if line.startswith("conductor_indexer_blocks_held "))
        assert float(held.split()[1]) >= 32
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 200 and all(f["ok"] for f in ready.json()["feeds"])


def test_a_lost_batch_is_replayed() -> None:
    tokens = list(range(1, 6 * BS + 1))
    with publishers(1) as (pub,), running_indexer(indexer_settings([pub.instance])) as (url, service):
        warm_up(pub, service)
        pub.publish([stored([101, 102], None, tokens[: 2 * BS])])
        pub.publish([stored([103, 104], 102, tokens[2 * BS : 4 * BS])], drop=True)  # never reaches the indexer
        pub.publish([stored([105, 106], 104, tokens[4 * BS :])])
        # blocks 3-4 only came from the replay socket; without them 5-6 could not be chained either
        assert wait_for(lambda: longest(url, tokens, "mixed-0") == 6 * BS, timeout=20)
        (sub,) = service.subscribers
        assert sub.stats.gaps >= 1 and sub.stats.replayed >= 1
        # a removal arrives in order and shortens the run
        pub.publish([{"type": "BlockRemoved", "block_hashes": [104], "medium": "GPU", "group_idx": 0}])
        assert wait_for(lambda: longest(url, tokens, "mixed-0") == 3 * BS, timeout=20)


def test_media_and_data_parallel_ranks_are_counted_apart() -> None:
    tokens = list(range(1, 4 * BS + 1))
    while True:  # rank r publishes on port + r (vLLM's rule): two free ports in a row
        port, replay = free_port(), free_port()
        pubs = []
        try:
            for r in range(2):
                pubs.append(VllmPublisher(port + r, replay + r, rank=r))
            break
        except zmq.ZMQError:  # taken by someone else: free what was bound and pick again
            for pub in pubs:
                pub.close()
    events = {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}", "data_parallel_size": 2}
    settings = indexer_settings([{"url": "http://127.0.0.1:9"}], kv={"kv_events": {"mixed-0": events}})
    try:
        with running_indexer(settings) as (url, service):
            for pub in pubs:
                warm_up(pub, service)
            pubs[0].publish([stored([1, 2, 3, 4], None, tokens)])
            pubs[0].publish([{**stored([1, 2], None, tokens[: 2 * BS]), "medium": "CPU"}])  # offloaded copies
            pubs[1].publish([stored([11], None, tokens[:BS])])

            def entry() -> dict[str, Any]:
                return dict(query(url, tokens).json()["default"]["mixed-0"])

            want = {"longest_matched": 4 * BS, "GPU": 4 * BS, "CPU": 2 * BS, "DISK": 0, "DP": {"0": 4 * BS, "1": BS}}
            assert wait_for(lambda: entry() == want, timeout=20), entry()
            pubs[0].publish([{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 0}])
            want = {"longest_matched": 2 * BS, "GPU": BS, "CPU": 2 * BS, "DISK": 0, "DP": {"0": 2 * BS, "1": BS}}
            assert wait_for(lambda: entry() == want, timeout=20), entry()
    finally:
        for pub in pubs:
            pub.close()


def test_feeds_not_reachable_keep_it_unready_with_the_reason() -> None:
    dead = {"url": "http://127.0.0.1:9", "kv_events_endpoint": f"tcp://*:{free_port()}"}
    with running_indexer(indexer_settings([dead])) as (url, _):
        r = httpx.get(url + "/ready")
        assert r.status_code == 503
        (feed,) = r.json()["feeds"]
        assert feed["ok"] is False and "unreachable" in feed["reason"] and feed["instance"] == "mixed-0"
        assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/query", b"{not json", 400, "not valid JSON"),
        ("/query", b"[1, 2]", 400, "Expected `object`"),
        ("/query", {"block_size": BS, "token_ids": [1]}, 400, "`model`"),
        ("/query", {"model": "", "block_size": BS, "token_ids": [1]}, 400, "model must not be empty"),
        ("/query", {"model": "m", "block_size": BS}, 400, "token_ids is required"),
        ("/query", {"model": "m", "block_size": BS, "token_ids": ["a"]}, 400, "$.token_ids[0]"),
        ("/query", {"model": "m", "block_size": BS, "token_ids": [-1]}, 400, "$.token_ids[0]"),
        ("/query", {"model": "m", "block_size": BS, "token_ids": [2**32]}, 400, "$.token_ids[0]"),
        ("/query", {"model": "m", "block_size": 32, "token_ids": [1]}, 400, "block_size 32"),
        ("/query", {"model": "m", "block_size": BS, "token_ids": [1] * 101}, 413, "exceed the limit"),
        ("/query", {"model": "m", "block_size": BS, "token_ids": [1], "instance_id": "nope"}, 404, "'nope'"),
        ("/query_by_hash", {"model": "m", "block_size": BS}, 400, "seq_hashes is required"),
        ("/query_by_hash", {"model": "m", "block_size": BS, "seq_hashes": [2**64]}, 400, "not a 64-bit hash"),
        ("/query_by_hash", {"model": "m", "block_size": BS, "seq_hashes": [1], "block_hash": [1]}, 400, "not both"),
        ("/query_by_hash", {"model": "m", "block_size": BS, "seq_hashes": [1.5]}, 400, "Expected `int`"),
        ("/query_by_hash", {"model": "m", "block_size": BS, "seq_hashes": [1] * 11}, 413, "exceed the limit"),
        ("/query_by_hash", b"x" * 5000, 413, "exceeds the limit"),
    ],
)
def test_bad_queries_get_openai_style_errors(path: str, body: bytes | dict[str, Any], status: int, says: str) -> None:
    with (
        publishers(1) as (pub,),
        running_indexer(
            indexer_settings([pub.instance], limits={"max_body_bytes": 4096}), QueryLimits(max_token_ids=100, max_hashes=10)
        ) as (
            url,
            _,
        ),
    ):
        kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(url + path, **kwargs)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert says in error["message"] and error["type"]


def test_other_methods_models_tenants_and_loras() -> None:
    tokens = list(range(1, 2 * BS + 1))
    with publishers(1) as (pub,), running_indexer(indexer_settings([pub.instance], models=["m"])) as (url, service):
        warm_up(pub, service)
        pub.publish([stored([1, 2], None, tokens)])
        assert wait_for(lambda: longest(url, tokens, "mixed-0") == 2 * BS, timeout=20)
        r = httpx.get(url + "/query")
        assert r.status_code == 405 and r.json()["error"]["message"]
        assert httpx.post(url + "/nowhere", json={}).status_code == 404
        r = httpx.post(url + "/query", json={"model": "other", "block_size": BS, "token_ids": tokens})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert query(url, tokens, tenant_id="someone-else").json() == {}
        # LoRA and salted blocks are never indexed: the instance is listed, holding none of them
        assert query(url, tokens, lora_name="adapter").json()["default"]["mixed-0"]["longest_matched"] == 0
        assert query(url, tokens, cache_salt="s").json()["default"]["mixed-0"]["longest_matched"] == 0


def test_cli_starts_an_indexer_from_the_config_file(tmp_path: Any) -> None:
    with publishers(1) as (pub,):
        port = free_port()
        config = tmp_path / "conductor.yaml"
        inst = pub.instance
        config.write_text(
            f"block_size: {BS}\nmixed:\n  - url: {inst['url']}\n"
            f"    kv_events_endpoint: '{inst['kv_events_endpoint']}'\n"
            f"    kv_events_replay_endpoint: '{inst['kv_events_replay_endpoint']}'\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "conductor", "indexer", "--config", str(config), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"

            def up() -> bool:
                try:
                    return httpx.get(url + "/ready", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            assert wait_for(up, timeout=30, interval=0.1), "the indexer did not become ready"
            tokens = list(range(1, 3 * BS + 1))
            # published before the indexer connected or after: the replay at start-up or the live feed has it
            pub.publish([stored([7, 8, 9], None, tokens)])

            def held() -> bool:
                pub.publish([{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}])
                return longest(url, tokens, "mixed-0") == 3 * BS

            assert wait_for(held, timeout=20, interval=0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def replica(settings: Settings, indexer_url: str) -> Gateway:
    """A gateway replica configured with `kv.index: indexer`: it ingests no events (the settings still
    name the workers' endpoints), asks the indexer, and remembers its own dispatches."""
    kv = settings.kv.model_copy(update={"index": "indexer", "indexer_url": indexer_url, "indexer_timeout_s": 2.0})
    gateway = Gateway(settings.model_copy(update={"kv": kv}))
    analyzer = gateway.analyzer
    assert isinstance(analyzer, KVAwareAnalyzer) and isinstance(analyzer.index, IndexerClient)
    assert not analyzer.subscribers
    return gateway


def test_a_replica_that_never_saw_a_prefix_routes_it_to_its_holder() -> None:
    with ExitStack() as stack:
        emus = [
            stack.enter_context(
                start_emulator("mixed", kv_events=True, kv_events_replay=True, time_scale=0.05, model="tiny", block_size=BS)
            )
            for _ in range(2)
        ]
        settings = indexer_settings(
            [worker(e) for e in emus], policy="kvcache_aware", kv={"enabled": True, "forward_token_ids": True}
        )
        indexer_url, _ = stack.enter_context(running_indexer(settings))
        first, second = (stack.enter_context(serve_gateway(replica(settings, indexer_url))).url for _ in range(2))
        shared = "You are a helpful assistant. " * 40  # ~1,100 byte tokens: 70 blocks
        r = httpx.post(
            first + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": shared + "First question?", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        counts = [len(httpx.get(e.url + "/emulator/requests").json()) for e in emus]
        holder = counts.index(1)
        prefix = list(shared.encode())[: len(shared) // BS * BS]
        assert wait_for(lambda: longest(indexer_url, prefix, f"mixed-{holder}") == len(prefix), timeout=20)
        for question in ("A different, second question?", "And a third one?"):
            r = httpx.post(
                second + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": shared + question, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix) - BS
        counts = [len(httpx.get(e.url + "/emulator/requests").json()) for e in emus]
        assert counts[holder] == 3 and counts[1 - holder] == 0, counts
