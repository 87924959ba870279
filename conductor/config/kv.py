"""The `kv:` settings: KV-cache awareness options (tokenizer, block keys, index, event feeds, agreement),
and the start-up warnings about settings that will make the index disagree with the workers.

Split from conductor/kv/analyzer.py (which re-exports both models) to keep that module about wiring.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conductor.core.event_bounds import DEFAULT_EVENT_BOUNDS, EventBounds
from conductor.core.memory_budgets import DEFAULT_INDEX_BUDGET_BYTES, DEFAULT_MAP_BUDGET_BYTES
from conductor.core.mooncake_naming import MooncakeStoreSettings
from conductor.core.prefix_memo import DEFAULT_MAX_ENTRIES
from conductor.core.types import Role
from conductor.core.vllm_hash import DEFAULT_NONE_HASH_SEED, HASH_ALGOS, seed_is_reproducible

# the analyzer's logger: these start-up warnings belong with the ones it logs later
log = logging.getLogger(__name__)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KVEventsEndpoint(_Model):
    """One instance's vLLM --kv-events-config, as given to that worker."""

    endpoint: str  # e.g. "tcp://*:5557" (vLLM binds, we connect) or "tcp://gateway:5557" (we bind)
    replay_endpoint: str | None = None  # e.g. "tcp://*:5558"
    topic: str = ""
    data_parallel_size: Annotated[int, Field(gt=0)] = 1  # rank r publishes on port + r (vLLM's rule)


class KVAwarenessSettings(_Model):
    """Options of the KV-aware analyzer; nested in the gateway settings as `kv`."""

    # on by default: the gateway's own scheduling (policy kvcache_aware) places requests by what each
    # worker has cached. Off (`--no-kv`): prompts are only estimated, no index, no KV event feeds
    enabled: bool = True
    # "auto": the workers' own POST /tokenize (vLLM serves it), the built-in byte tokenizer with a
    # warning where the workers do not (adapters/auto_tokenizer.py); "worker": a worker's /tokenize,
    # nothing else; "builtin" (UTF-8 bytes: the emulated workers'); or a local Hugging Face tokenizer dir
    tokenizer: str = "auto"
    tokenizer_url: str | None = None  # for "worker" and "auto": defaults to the prefill/mixed instances
    forward_token_ids: bool = True  # send completions prompts on as token ids (tokenized once)
    # keep each prompt's token ids in its analysis (set by the gateway for prefill-to-prefill pulls)
    keep_token_ids: bool = False
    block_size: Annotated[int, Field(gt=0)] = 16  # must equal the workers' --block-size
    key_mode: Literal["xxhash", "vllm"] = "xxhash"
    hash_seed: int = 0  # xxhash mode: seed of the key chain (all replicas must agree)
    vllm_hash_algo: str = "sha256"  # vllm mode: the workers' --prefix-caching-hash-algo
    # vllm mode: the PYTHONHASHSEED the *workers* run with ("123" or 123: workers run with
    # PYTHONHASHSEED=123). None: the workers run without it, which vLLM's sha256 / sha256_cbor
    # turn into the fixed seed "vllm-none-hash"; with xxhash / xxhash_cbor vLLM then draws a random
    # seed in every worker process and no gateway can compute its hashes (a start-up warning says
    # so: start the workers with PYTHONHASHSEED and set it here too, or use key_mode xxhash, which
    # translates events). The gateway's own PYTHONHASHSEED is never used.
    vllm_hash_seed: str | None = None
    # Block keys of shared prompt prefixes remembered (conductor/core/prefix_memo.py): "auto" = in
    # vllm key mode, whose hashes cost 2-6 ms per 8K-token prompt (0.32-0.40x of that with a 75%
    # shared prefix, benchmarks/bench_prefix_memo.py); the own xxhash keys are cheaper than the memo.
    prefix_memo: Literal["auto", "on", "off"] = "auto"
    prefix_memo_entries: Annotated[int, Field(gt=0)] = DEFAULT_MAX_ENTRIES  # 256-token strides, ~330 bytes each
    # "redis_cluster": a Redis Cluster (adapters/index/redis_cluster.py); redis_url then names its startup
    # node(s), comma-separated ("redis://10.0.0.1:7000,redis://10.0.0.2:7000"); the client finds the rest
    # "indexer": read a `conductor indexer` (conductor/indexer/service.py) over HTTP at indexer_url; it ingests the
    # workers' KV events, so this gateway subscribes to none and keeps only its own dispatch guesses
    # (adapters/index/remote.py). Look-ups give up after indexer_timeout_s and answer from those guesses.
    index: Literal["memory", "redis", "redis_cluster", "indexer"] = "memory"
    indexer_url: str | None = None
    indexer_timeout_s: Annotated[float, Field(gt=0)] = 0.1
    indexer_model: str | None = None  # the model look-ups name; default: the gateway's first served model
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "conductor:kv:"
    # Redis calls give up after these (look-ups are on the request path; writes run beside it), and
    # after redis_breaker_failures in a row none is tried for redis_breaker_open_s (adapters/breaker.py)
    redis_timeout_s: Annotated[float, Field(gt=0)] = 0.05
    redis_write_timeout_s: Annotated[float, Field(gt=0)] = 0.25
    redis_breaker_failures: Annotated[int, Field(gt=0)] = 3
    redis_breaker_open_s: Annotated[float, Field(gt=0)] = 1.0
    # while Redis cannot be used: "memory" = answer from a local copy fed by the same events and
    # dispatches (sized by index_memory_bytes), "none" = route as if nothing were cached
    redis_fallback: Literal["memory", "none"] = "memory"
    # In-process memory, in bytes: the index (or the local copy beside Redis) and, per instance, the
    # vLLM hash -> own key map of xxhash mode. Defaults: 48 MiB + 16 MiB per instance, 112 MiB for 2P+2D.
    index_memory_bytes: Annotated[int, Field(gt=0)] = DEFAULT_INDEX_BUDGET_BYTES
    hash_map_memory_bytes_per_instance: Annotated[int, Field(gt=0)] = DEFAULT_MAP_BUDGET_BYTES
    # entries on the Redis server (None: 1,000,000); when set, also caps the in-process index
    max_blocks: Annotated[int, Field(gt=0)] | None = None
    key_ttl_s: Annotated[float, Field(gt=0)] = 3600.0
    unconfirmed_ttl_s: Annotated[float, Field(gt=0)] = 30.0
    kv_events: Mapping[str, KVEventsEndpoint] = Field(default_factory=dict)  # instance id -> endpoint
    replay_timeout_s: float = 1.0
    # what a KV-event publisher may send (adapters/kv_events.py): a message's bytes (ZMQ drops a bigger
    # one before buffering it), how far its sequence number may jump before the jump is held until the
    # feed confirms it, how many blocks are applied before the event loop gets a turn, and how often a
    # bad message may be logged per instance (every one is counted)
    events_max_message_bytes: int = Field(default=DEFAULT_EVENT_BOUNDS["max_message_bytes"], gt=0)
    events_max_seq_jump: int = Field(default=DEFAULT_EVENT_BOUNDS["max_seq_jump"], gt=0)
    events_slice_blocks: int = Field(default=DEFAULT_EVENT_BOUNDS["slice_blocks"], gt=0)
    events_log_interval_s: float = Field(default=DEFAULT_EVENT_BOUNDS["log_interval_s"], gt=0)

    def event_bounds(self) -> EventBounds:
        """The bounds above as adapters.kv_events.EventSubscriber takes them."""
        return EventBounds(
            max_message_bytes=self.events_max_message_bytes,
            max_seq_jump=self.events_max_seq_jump,
            slice_blocks=self.events_slice_blocks,
            log_interval_s=self.events_log_interval_s,
        )

    # at start-up, apply everything each worker's replay socket still buffers (from seq 0), so a
    # gateway started after its workers knows what they cached (as far back as vLLM's buffer_steps)
    replay_on_start: bool = True
    events_silence_s: float = 30.0  # no events this long and a failed /health: drop the instance
    # the KV canary (conductor/kv/canary.py): a short prompt sent to each prefill/mixed instance with
    # a KV events endpoint when it joins or its engine restarts, whose events must key its blocks as
    # the gateway does before its cache counts in placement. canary_timeout_s: how long one run waits
    # for the canary's events in all (start-up waits at most twice this), split over canary_attempts sends
    canary: bool = True
    canary_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    canary_attempts: Annotated[int, Field(gt=0, le=10)] = 3
    mooncake: MooncakeStoreSettings | None = None
    agreement_window: Annotated[int, Field(gt=0)] = 200  # requests in the hash agreement window
    agreement_min_samples: Annotated[int, Field(gt=0)] = 20
    agreement_alarm_below: float = 0.2  # confirmed/predicted cached tokens below this: warn (over-prediction)
    agreement_coverage_alarm_below: float = 0.8  # confirmed/reported below this: warn (under-prediction)
    # the most characters one token stands for: a prompt text longer than limits.max_prompt_tokens
    # times this is refused before it is tokenized (conductor/kv/prompt_bounds.py). None: the
    # tokenizer's own (builtin 1, a tokenizer directory its longest vocabulary entry, 'worker' 32)
    max_chars_per_token: Annotated[int, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _indexer_has_url(self) -> KVAwarenessSettings:
        if self.index == "indexer" and not self.indexer_url:
            raise ValueError("kv.index 'indexer' needs kv.indexer_url (the conductor indexer's base URL)")
        if self.key_mode == "vllm" and self.vllm_hash_algo not in HASH_ALGOS:  # else a traceback at start-up
            raise ValueError(f"kv.vllm_hash_algo must be one of {', '.join(HASH_ALGOS)}, not {self.vllm_hash_algo!r}")
        return self

    @field_validator("vllm_hash_seed", mode="before")
    @classmethod
    def _seed_text(cls, v: Any) -> Any:
        # YAML and CONDUCTOR_* values parse `123` as a number; PYTHONHASHSEED is text all the same
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


def warn_about_setup(s: KVAwarenessSettings, instances: Sequence[tuple[str, Role, str]]) -> None:
    """Say at start-up what will make the index disagree with the workers, before it does."""
    if s.key_mode == "vllm" and not seed_is_reproducible(s.vllm_hash_algo, s.vllm_hash_seed):
        log.warning(
            "VLLM HASH SEED UNSET with kv.vllm_hash_algo %r: vLLM seeds its xxhash block hashes with random "
            "bytes in every worker process when PYTHONHASHSEED is unset, so no gateway can compute them and no "
            "cache hit will be predicted. Start the workers with PYTHONHASHSEED=<n> and set kv.vllm_hash_seed "
            "to the same value, or use kv.key_mode xxhash (it translates the events' hashes).",
            s.vllm_hash_algo,
        )
    own = os.environ.get("PYTHONHASHSEED")
    if s.key_mode == "vllm" and s.vllm_hash_seed is None and own is not None:
        log.warning(
            "kv.vllm_hash_seed is unset, so the workers are taken to run without PYTHONHASHSEED (vLLM's seed %r "
            "for sha256*); the gateway's own PYTHONHASHSEED=%s is NOT used. If the workers run with "
            "PYTHONHASHSEED, set kv.vllm_hash_seed to their value.",
            DEFAULT_NONE_HASH_SEED,
            own,
        )
    if s.tokenizer == "builtin":
        log.info(
            "kv.tokenizer is 'builtin' (UTF-8 bytes): its keys match only emulated workers; against a real "
            "model set kv.tokenizer to 'auto' (the workers' /tokenize, the default) or the model's tokenizer directory"
        )
    silent = [iid for iid, role, _ in instances if role != Role.DECODE and iid not in s.kv_events]
    if silent and s.index != "indexer":  # with an indexer, it subscribes, not this gateway
        log.info(
            "no KV events endpoint for %s: the index knows their caches only from this gateway's dispatches, "
            "forgotten after kv.unconfirmed_ttl_s (%.0fs)",
            ", ".join(silent),
            s.unconfirmed_ttl_s,
        )
