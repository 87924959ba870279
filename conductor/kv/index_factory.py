"""The KV index the settings name (`kv.index`): in memory, a Redis or Redis Cluster behind a circuit
breaker with an in-memory fallback, or a `conductor indexer` service; each bounded.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from adapters.breaker import CircuitBreaker, register_breaker
from adapters.index.base import IndexLimits, KVIndex, MemoryUse
from adapters.index.guarded import GuardedIndex
from adapters.index.memory import MemoryIndex, blocks_within
from adapters.index.metrics import register_guard
from conductor.config.kv import KVAwarenessSettings
from conductor.core.block_keys import BlockKeyScheme, VllmKeys, XxhashKeys
from conductor.core.prefix_memo import PrefixMemo

log = logging.getLogger(__name__)  # the breaker's lines, where they always were

REDIS_MAX_BLOCKS = 1_000_000  # entries a Redis index keeps when kv.max_blocks is unset (server memory)


def make_index(s: KVAwarenessSettings, registry: CollectorRegistry | None) -> KVIndex:
    """The index `s.index` names, guarded by a breaker (and a local fallback) where it is remote; used by the
    gateway and by `conductor indexer`."""
    unconfirmed = {"unconfirmed_ttl_s": s.unconfirmed_ttl_s, "key_ttl_s": s.key_ttl_s}
    local_cap = min(blocks_within(s.index_memory_bytes), s.max_blocks or sys.maxsize)
    local = IndexLimits(max_blocks=local_cap, **unconfirmed)
    if s.index == "memory":
        return MemoryIndex(local)
    if s.index == "indexer":  # the client keeps its own breaker and answers from its guesses on failure
        from adapters.index.remote import IndexerClient

        assert s.indexer_url is not None  # the settings' validator says so
        return IndexerClient(
            s.indexer_url,
            local,
            s.indexer_timeout_s,
            block_size=s.block_size,
            model=s.indexer_model or "default",
            breaker_failures=s.redis_breaker_failures,
            breaker_open_s=s.redis_breaker_open_s,
        )
    from adapters.index.redis import RedisIndex

    shared = IndexLimits(max_blocks=s.max_blocks or REDIS_MAX_BLOCKS, **unconfirmed)
    primary: KVIndex
    if s.index == "redis_cluster":  # redis_url: the cluster's startup node(s), comma-separated
        from adapters.index.redis_cluster import RedisClusterIndex

        primary = RedisClusterIndex(
            s.redis_url,
            prefix=s.redis_prefix,
            limits=shared,
            timeout_s=s.redis_timeout_s,
            write_timeout_s=s.redis_write_timeout_s,
        )
    else:
        primary = RedisIndex(
            s.redis_url,
            prefix=s.redis_prefix,
            limits=shared,
            timeout_s=s.redis_timeout_s,
            write_timeout_s=s.redis_write_timeout_s,
        )
    breaker = CircuitBreaker(
        "KV index Redis", failures_to_open=s.redis_breaker_failures, open_s=s.redis_breaker_open_s, logger=log
    )
    index = GuardedIndex(
        primary,
        breaker,
        fallback=MemoryIndex(local) if s.redis_fallback == "memory" else None,
        lookup_timeout_s=s.redis_timeout_s,
        write_timeout_s=s.redis_write_timeout_s,
    )
    if registry is not None:
        register_breaker(breaker, registry, "conductor_kv_index_redis")
        register_guard(registry, index)
    return index


def index_memory(index: KVIndex) -> Callable[[], MemoryUse | None]:
    """What the index reports of its memory use, for the metrics (nothing when it does not)."""
    memory: Callable[[], MemoryUse | None] | None = getattr(index, "memory", None)
    return memory if memory is not None else lambda: None


def prefix_memo(s: KVAwarenessSettings, scheme: BlockKeyScheme) -> PrefixMemo | None:
    """The memo of shared prefixes' keys the settings ask for (kv.prefix_memo)."""
    wanted = s.prefix_memo == "on" or (s.prefix_memo == "auto" and s.key_mode == "vllm")
    if not wanted or not isinstance(scheme, XxhashKeys | VllmKeys):  # both can resume their chains
        return None
    return PrefixMemo(scheme, max_entries=s.prefix_memo_entries)
