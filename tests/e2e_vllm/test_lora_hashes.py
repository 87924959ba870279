"""A LoRA adapter's block hashes and KV events, computed by the installed vLLM itself, against
Conductor's: the gateway's keys for a prompt run with an adapter equal vLLM's own hashes in every
algorithm, and vLLM's BlockStored for those blocks lands in the index under those keys (both key
modes). The fixed vectors of the same check, for runs without vLLM: tests/conductor/kv/test_lora_keys.py.

No engine is started: vLLM's hashing and block pool run in a plain process under its Python.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.kv_event_batch import decode_batch
from conductor.core.adapter_keys import scheme_for_adapter
from conductor.core.block_keys import VllmKeys, XxhashKeys
from conductor.core.models import AdapterCard

PROBE = Path(__file__).with_name("lora_block_hashes.py")
ADAPTER = AdapterCard("sql-lora", "tiny", "/adapters/sql")
TOKENS = [(7 * i + 3) % 5000 for i in range(100)]  # six full blocks of 16 and a partial one


def _vllm_hashes(python: str, seed: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    argv = [python, str(PROBE), ADAPTER.name, ADAPTER.path, "16", *map(str, TOKENS)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("seed", [None, "0"])
def test_adapter_keys_and_events_equal_vllms_own(vllm_python: str, seed: str | None) -> None:
    found = _vllm_hashes(vllm_python, seed)
    assert set(found) >= {"sha256", "sha256_cbor"}
    for algo, vllm in found.items():
        scheme = scheme_for_adapter(VllmKeys(16, algo, seed), ADAPTER)
        assert isinstance(scheme, VllmKeys)
        assert [d.hex() for d in scheme.digests(TOKENS)] == vllm["digests"], algo
        keys = scheme.keys(TOKENS)
        (stored,) = decode_batch(bytes.fromhex(vllm["event_batch"])).events
        assert stored.block_hashes == tuple(keys), algo  # type: ignore[union-attr]
        for mode, base in (("vllm", VllmKeys(16, algo, seed)), ("xxhash", XxhashKeys(16, seed=5))):
            index = MemoryIndex()
            feeder = IndexFeeder(index, base, translate=mode == "xxhash", adapter_of=lambda _i, _n: ADAPTER)
            asyncio.run(feeder.on_batch("w", decode_batch(bytes.fromhex(vllm["event_batch"]))))
            ours = scheme_for_adapter(base, ADAPTER)
            assert ours is not None
            match = asyncio.run(index.match(ours.keys(TOKENS)))
            assert match.confirmed_blocks == {"w": len(keys)}, (algo, mode)
            if mode == "vllm":  # the prompt-start check recomputed vLLM's hash with the adapter
                assert (feeder.instance("w").hash_checked, feeder.instance("w").hash_mismatched) == (1, 0)
