"""LoRA adapters on the emulator, as vLLM serves them: listed in /v1/models, loaded at start and at
run time, a request's adapter hashed into its blocks and named in its KV events (checked from the
published wire format and vLLM's documented hashing only)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import cbor2
import httpx
import pytest

from adapters.emulator.lora import LoraAdapters, LoraModule, parse_lora_modules, runtime_updates_allowed
from adapters.emulator.openai_format import ApiError
from tests.support.emulator import Emulator, start_emulator

BLOCK = 16
NAME, PATH = "sql-lora", "/adapters/sql"


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    """A mixed instance serving the adapter from the start, runtime updates allowed, events on."""
    with start_emulator(
        "mixed",
        kv_events=True,
        time_scale=0.01,
        model="tiny",
        hash_algo="sha256_cbor",
        lora_modules=f"{NAME}={PATH}",
        allow_runtime_lora_updating=True,
    ) as e:
        yield e


@pytest.fixture(autouse=True)
def _reset(emu: Emulator) -> Iterator[None]:
    httpx.post(emu.url + "/emulator/reset", timeout=30).raise_for_status()
    yield
    httpx.post(emu.url + "/v1/unload_lora_adapter", json={"lora_name": "other"}, timeout=30)


def _event_ids(tokens: list[int], extra: tuple[Any, ...] | None) -> list[int]:
    """sha256_cbor block hashes (low 64 bits) as vLLM documents them, with `extra` in every block."""
    parent = hashlib.sha256(cbor2.dumps(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"), canonical=True)).digest()
    out = []
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), extra), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def _complete(emu: Emulator, model: str, tokens: list[int]) -> httpx.Response:
    return httpx.post(emu.url + "/v1/completions", json={"model": model, "prompt": tokens, "max_tokens": 1}, timeout=30)


def test_models_list_the_adapter_as_vllm_does(emu: Emulator) -> None:
    cards = {c["id"]: c for c in httpx.get(emu.url + "/v1/models", timeout=30).json()["data"]}
    assert cards["tiny"]["parent"] is None
    lora = cards[NAME]
    assert (lora["root"], lora["parent"], lora["owned_by"], lora["max_model_len"]) == (PATH, "tiny", "vllm", None)


def test_a_request_for_the_adapter_is_served_and_an_unknown_one_is_404(emu: Emulator) -> None:
    r = _complete(emu, NAME, list(range(1, 40)))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == NAME
    missing = _complete(emu, "no-such-lora", list(range(1, 40)))
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The model `no-such-lora` does not exist."


def test_the_adapters_blocks_are_its_own_in_the_cache_and_the_events(emu: Emulator, subscriber: Any) -> None:
    sub = subscriber(emu)
    tokens = [(5 * i + 1) % 250 for i in range(40)]
    assert _complete(emu, NAME, tokens).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = _complete(emu, NAME, tokens).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    base = _complete(emu, "tiny", tokens).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (again, base) == (32, 0)  # the adapter's blocks are no hit for the base model
    stored = [e for e in sub.events_until_reset(emu) if e["type"] == "BlockStored"]
    lora_event, base_event = stored
    assert lora_event["block_hashes"] == _event_ids(tokens, (("lora", NAME, PATH),))
    assert lora_event["lora_name"] == NAME and lora_event["lora_id"] == 1
    assert lora_event["extra_keys"] == [[NAME], [NAME]]  # untagged, one entry a block; no path
    assert base_event["block_hashes"] == _event_ids(tokens, None)
    assert base_event["lora_name"] is None and base_event["extra_keys"] == [None, None]


def test_runtime_load_and_unload_as_vllm_answers_them(emu: Emulator) -> None:
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": "/adapters/other"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'other' added successfully."
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": "/adapters/other"})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": "/p"}).status_code == 400
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        assert (cards["other"]["root"], cards["other"]["parent"]) == ("/adapters/other", "tiny")
        assert _complete(emu, "other", list(range(1, 20))).status_code == 200
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "other"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'other' removed successfully."
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "other"}).status_code == 404
        assert _complete(emu, "other", list(range(1, 20))).status_code == 404


def test_without_runtime_updates_the_routes_do_not_exist() -> None:
    with start_emulator("mixed", time_scale=0.01, model="tiny") as plain:
        r = httpx.post(plain.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}, timeout=30)
        assert r.status_code == 404
        assert [c["id"] for c in httpx.get(plain.url + "/v1/models", timeout=30).json()["data"]] == ["tiny"]


def test_lora_modules_forms_ids_and_the_environment_switch() -> None:
    modules = parse_lora_modules(["a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "big"}'])
    assert modules == (LoraModule("a", "/p/a"), LoraModule("b", "/p/b", "big"))
    with pytest.raises(ValueError):
        parse_lora_modules(['{"name": "c"}'])
    loras = LoraAdapters("tiny", modules)
    a, b = loras.get("a"), loras.get("b")
    assert a is not None and b is not None
    assert (a.lora_id, b.lora_id, a.base, b.base) == (1, 2, "tiny", "big")
    assert loras.load("a", "/p/a2", inplace=True).lora_id == 1  # reloaded in place: its id is kept
    with pytest.raises(ApiError):
        loras.unload("zz")
    assert runtime_updates_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_updates_allowed({})
