"""Run under vLLM's Python (tests/e2e_vllm/test_lora_hashes.py runs it): vLLM's own block hashes and
KV event of a request that uses a LoRA adapter, as JSON on stdout.

    python lora_block_hashes.py NAME PATH BLOCK_SIZE TOKENS...

For each prefix-caching algorithm: the request's block hashes (vLLM's `get_request_block_hasher` on
a `Request` with a `LoRARequest`), and the KV event batch vLLM's block pool publishes when it caches
those blocks (msgpack, hex). NONE_HASH follows this process's PYTHONHASHSEED, as in a vLLM worker;
without one only the sha256 algorithms are reproducible, so only they are run then.
"""

from __future__ import annotations

import json
import os
import sys

import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request


def main(argv: list[str]) -> None:
    name, path, block_size, tokens = argv[0], argv[1], int(argv[2]), [int(t) for t in argv[3:]]
    algos = ["sha256", "sha256_cbor"]
    if os.environ.get("PYTHONHASHSEED") is not None:
        algos += ["xxhash", "xxhash_cbor"]
    out = {}
    for algo in algos:
        fn = get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(fn)
        lora = LoRARequest(lora_name=name, lora_int_id=3, lora_path=path)
        request = Request(
            request_id="r",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            lora_request=lora,
            block_hasher=kv_cache_utils.get_request_block_hasher(block_size, fn),
        )
        full = len(tokens) // block_size
        pool = BlockPool(full + 2, True, block_size, enable_kv_cache_events=True)  # one is its null block
        pool.cache_full_blocks(request, pool.get_new_blocks(full + 1), 0, full, block_size, 0)
        batch = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=pool.take_events()))
        out[algo] = {"digests": [h.hex() for h in request.block_hashes], "event_batch": batch.hex()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
