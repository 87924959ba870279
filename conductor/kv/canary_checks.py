"""What a KV canary's events say about the gateway's block keys: the pure half of conductor/kv/canary.py.

The canary sends an instance a prompt of known token ids and waits for the BlockStored event of its
first blocks. That one event is enough to tell every setting the index depends on: its block size
is the worker's --block-size; in "vllm" key mode its hashes are the worker's own hashes of tokens
the gateway knows, so the gateway recomputes them and, when they differ, tries the other hash
algorithms and the unset seed to name which setting is off; extra keys the gateway cannot rebuild
(a cache salt, multimodal inputs) show in the event itself. No event at all means the feed does
not deliver. Each outcome names the setting to fix.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from adapters.kv_event_batch import BlockStored
from conductor.core.adapter_keys import event_adapter
from conductor.core.block_keys import BlockKeyScheme, VllmKeys
from conductor.core.vllm_hash import HASH_ALGOS

Result = Literal[
    "verified",  # the worker's events key its blocks as the gateway does
    "block_size",  # kv.block_size is not the worker's --block-size
    "hash_algo",  # kv.vllm_hash_algo is not the worker's --prefix-caching-hash-algo
    "hash_seed",  # kv.vllm_hash_seed is not the worker's PYTHONHASHSEED
    "extra_keys",  # the worker hashes more than the tokens into a plain prompt's blocks
    "tokenizer",  # the gateway's token ids of a text are not the worker's
    "no_events",  # no BlockStored of the canary's prompt arrived (or no endpoint is configured)
    "unreachable",  # the worker did not answer the canary's request
    "late_start",  # keyed right, but the worker cached blocks before the gateway listened (not excluded)
]
RESULTS: tuple[Result, ...] = (
    "verified",
    "block_size",
    "hash_algo",
    "hash_seed",
    "extra_keys",
    "tokenizer",
    "no_events",
    "unreachable",
    "late_start",
)

# token ids the canary draws from: below every real vocabulary's size, above the usual specials
# (0-2: <unk>, <s>, </s> in Llama-style vocabularies)
_LOW_ID, _HIGH_ID = 3, 256
# 256 tokens and one: a full block even for a worker whose --block-size is 256 (larger than the
# gateway's), so a block size mismatch shows as one, not as missing events
MIN_CANARY_TOKENS = 257
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bakers", "count")


@dataclass(frozen=True, slots=True)
class Verdict:
    result: Result
    detail: str  # what was seen and the setting to fix

    @property
    def ok(self) -> bool:
        return self.result == "verified"


@dataclass(frozen=True, slots=True)
class KeySetup:
    """The gateway's own block key settings, as the canary compares and quotes them."""

    block_size: int
    translate: bool  # "xxhash" key mode: own keys chained from the events' token ids
    algo: str = "sha256"
    seed: str | None = None


def canary_tokens(block_size: int, rng: random.Random | None = None) -> list[int]:
    """A fresh prompt of random token ids: no worker can have it cached, so its blocks are stored
    (and announced) anew each time; long enough for two blocks and for any block size up to 256."""
    rng = rng or random.SystemRandom()
    return [rng.randrange(_LOW_ID, _HIGH_ID) for _ in range(max(2 * block_size + 1, MIN_CANARY_TOKENS))]


def canary_text(block_size: int) -> str:
    """A text canary: a random tag and enough words for several blocks with any real tokenizer."""
    nonce = canary_tokens(1)[:4]
    words = [_WORDS[(i * 7 + nonce[i % 4]) % len(_WORDS)] for i in range(4 * block_size)]
    return "Canary " + "-".join(map(str, nonce)) + ": " + " ".join(words)


def starts_prompt(ev: BlockStored, tokens: Sequence[int]) -> bool:
    """Whether `ev` stores the first blocks of the prompt `tokens` (what the canary waits for)."""
    n = len(ev.token_ids)
    return ev.parent_block_hash is None and 0 < n <= len(tokens) and tuple(tokens[:n]) == ev.token_ids


def judge(ev: BlockStored, tokens: Sequence[int], scheme: BlockKeyScheme, setup: KeySetup) -> Verdict:
    """The verdict on the event that stored the canary prompt's first blocks."""
    if ev.block_size != setup.block_size:
        return Verdict(
            "block_size",
            f"the worker stores blocks of {ev.block_size} tokens but the gateway keys {setup.block_size}-token "
            f"blocks: set block_size (kv.block_size) to {ev.block_size}, the worker's --block-size",
        )
    keyable, lora = event_adapter(ev.lora_name, ev.extra_keys, ev.lora_id)
    if not keyable or lora is not None:
        return Verdict(
            "extra_keys",
            f"the worker hashed extra keys into a plain prompt's blocks (lora {lora!r}, extra keys "
            f"{str(ev.extra_keys)[:80]}): a cache salt or a default adapter the gateway cannot rebuild; "
            "start the worker without them",
        )
    if setup.translate:  # own keys chained from the events' token ids: any vLLM hash will do
        return Verdict("verified", f"block size {setup.block_size}, events translated to the gateway's keys")
    n = len(ev.block_hashes)
    ours = scheme.keys(tokens[: n * setup.block_size])
    if list(ev.block_hashes) == ours[:n]:
        return Verdict("verified", f"block size {setup.block_size}, vLLM hashes {setup.algo} seed {setup.seed!r}")
    return _hash_verdict(ev, tokens, setup)


def _hash_verdict(ev: BlockStored, tokens: Sequence[int], setup: KeySetup) -> Verdict:
    """Which hash setting is off: another algorithm with the same seed, or the unset seed, when
    either gives the worker's first hash; else the seed (it cannot be guessed)."""
    first = tokens[: setup.block_size]
    seen = f"(worker {ev.block_hashes[0]:#018x})"
    for algo in HASH_ALGOS:
        if algo != setup.algo and _first_hash(algo, setup.seed, setup.block_size, first) == ev.block_hashes[0]:
            return Verdict(
                "hash_algo",
                f"the worker hashes blocks with {algo} {seen}, the gateway with {setup.algo}: set "
                f"kv.vllm_hash_algo to {algo!r}, the worker's --prefix-caching-hash-algo",
            )
    if setup.seed is not None and _first_hash(setup.algo, None, setup.block_size, first) == ev.block_hashes[0]:
        return Verdict(
            "hash_seed",
            f"the worker runs without PYTHONHASHSEED {seen} but kv.vllm_hash_seed is {setup.seed!r}: "
            "unset kv.vllm_hash_seed, or start the worker with PYTHONHASHSEED set to it",
        )
    told = "is unset (workers without PYTHONHASHSEED)" if setup.seed is None else repr(setup.seed)
    return Verdict(
        "hash_seed",
        f"the worker's block hashes are not the gateway's vLLM hashes of the same tokens {seen}: "
        f"kv.vllm_hash_seed {told} (kv.vllm_hash_algo {setup.algo!r}) is not the worker's "
        "PYTHONHASHSEED; set it to the worker's value (the gateway's own PYTHONHASHSEED is never used)",
    )


def _first_hash(algo: str, seed: str | None, block_size: int, first: Sequence[int]) -> int | None:
    try:
        return VllmKeys(block_size, algo, seed).keys(first)[0]
    except Exception:  # noqa: BLE001  # an algorithm this machine cannot compute (no xxhash), or no seed
        return None


def tokenizer_verdict(
    gateway_ids: Sequence[int], worker_tokens: int | None, event_ids: Sequence[int] | None, tokenizer: str
) -> Verdict:
    """The verdict of the text canary: the worker's prompt length (usage) and, when it came, the
    event of the text's first blocks, against the gateway's own token ids of the same text."""
    if event_ids is not None and (worker_tokens is None or worker_tokens == len(gateway_ids)):
        return Verdict("verified", f"kv.tokenizer {tokenizer!r} gives the worker's token ids")
    counted = (
        "" if worker_tokens is None else f" (the worker counted {worker_tokens} prompt tokens, the gateway {len(gateway_ids)})"
    )
    return Verdict(
        "tokenizer",
        f"the worker's token ids of the canary's text are not the gateway's{counted}: kv.tokenizer "
        f"{tokenizer!r} is not the model's; set kv.tokenizer to the model's tokenizer directory or 'worker'",
    )


def no_events(endpoint: str | None, sent: int, waited_s: float) -> Verdict:
    if endpoint is None:
        return Verdict(
            "no_events",
            "no KV events endpoint is configured: the index knows only this gateway's dispatches; give the "
            "instance a kv_events_endpoint (the worker's --kv-events-config)",
        )
    return Verdict(
        "no_events",
        f"no KV event of {sent} canary prompts arrived from {endpoint} within {waited_s:.1f}s: check the "
        "worker's --kv-events-config (enable_kv_cache_events, publisher zmq, endpoint) and that the gateway reaches it",
    )


def late_start(missed: int, replay: bool) -> Verdict:
    """Keyed right, but `missed` batches went out before the gateway listened and were not replayed."""
    fix = (
        "keep kv.replay_on_start on so the gateway asks the replay socket for them"
        if replay
        else "give the instance a kv_events_replay_endpoint (the worker's replay_endpoint) and keep kv.replay_on_start on"
    )
    return Verdict(
        "late_start",
        f"the events are keyed right, but the worker published {missed} event batches before the gateway "
        f"listened and none was replayed: the prefixes it cached before are unknown to the index; {fix}",
    )
