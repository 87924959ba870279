"""`IndexerClient`: a KVIndex for gateway replicas that reads from a `conductor indexer` over HTTP.

    IndexerClient(url, limits, timeout_s, *, block_size=16, model="default", tenant_id="default",
                  breaker_failures=3, breaker_open_s=1.0, max_connections=8)

- url: the indexer's base URL (e.g. http://conductor-indexer:8100).
- limits: `IndexLimits` of the local overlay below (max_blocks caps it; unconfirmed_ttl_s is how
  long a dispatch guess counts).
- timeout_s: the whole look-up round trip; past it (or on any failure) the look-up answers from the
  overlay alone. After `breaker_failures` failures in a row the indexer is not asked for
  `breaker_open_s` at a time (`adapters/breaker.py`), so a dead indexer costs requests nothing.
- block_size, model, tenant_id: what each query says (RFC 1403 requires model and block_size); the
  block size must be the indexer's (it answers 400 otherwise) and is how tokens become blocks again.

Semantics, per `KVIndex` method:
- `match(keys)`: POST /query_by_hash {"model", "block_size", "tenant_id", "seq_hashes": keys, "holders_only": true} (keys are
  the gateway's block keys, which are the indexer's hashes when both use the same kv.key_mode and seed);
  each instance's `longest_matched` / block_size is its confirmed run, its tier "device" when the GPU
  run covers it, else "host". Merged with the overlay: an instance's run is the longer of the two, and
  where the confirmed run stops, the overlay's guesses may carry it further (one hand-over).
  Where the indexer confirms what the overlay guessed, the guesses are dropped: the indexer's answer
  is the truth for them from then on (a later eviction is not hidden behind a guess).
- `insert(instance, keys, confirmed=False)`: a dispatch guess, kept in the overlay only, for
  limits.unconfirmed_ttl_s. With confirmed=True (a gateway that also subscribes to events itself)
  the entries are kept in the overlay as confirmed, until evicted or removed.
- `remove`, `drop_instance`, `apply` (a batch of writes): the overlay only; the indexer learns
  removals from the workers' events.
- `stats`, `memory`: the overlay's (what this process holds); `close`: the connection pool too.

One pooled `httpx.AsyncClient` (keep-alive, created on first use inside the serving loop).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from adapters.breaker import CircuitBreaker
from adapters.index.base import IndexLimits, IndexStats, MemoryUse, PrefixMatch, Write
from adapters.index.memory import MemoryIndex
from conductor.core.types import Tier

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode


class IndexerError(Exception):
    """The indexer answered something other than a look-up result."""


def parse_answer(payload: bytes, tenant_id: str, block_size: int) -> PrefixMatch:
    """An RFC 1403 answer ({tenant: {instance: {longest_matched, GPU, CPU, ...}}}) as a PrefixMatch."""
    data: Any = msgspec.json.decode(payload)
    if not isinstance(data, dict):
        raise IndexerError(f"answer is not a JSON object: {payload[:200]!r}")
    per_instance = data.get(tenant_id, {})
    if not isinstance(per_instance, dict):
        raise IndexerError(f"answer for tenant {tenant_id!r} is not an object")
    blocks: dict[str, int] = {}
    tiers: dict[str, Tier] = {}
    for instance, entry in per_instance.items():
        if not isinstance(entry, dict):
            raise IndexerError(f"answer for instance {instance!r} is not an object")
        longest = int(entry.get("longest_matched", 0))
        n = longest // block_size
        if n <= 0:
            continue
        blocks[instance] = n
        tiers[instance] = Tier.DEVICE if int(entry.get("GPU", 0)) >= longest else Tier.HOST
    return PrefixMatch(blocks=blocks, tiers=tiers, confirmed_blocks=dict(blocks))


class IndexerClient:
    """KVIndex reading a `conductor indexer`, with a local overlay of this gateway's dispatch guesses."""

    def __init__(
        self,
        url: str,
        limits: IndexLimits,
        timeout_s: float,
        *,
        block_size: int = 16,
        model: str = "default",
        tenant_id: str = "default",
        breaker_failures: int = 3,
        breaker_open_s: float = 1.0,
        max_connections: int = 8,
    ) -> None:
        if timeout_s <= 0 or block_size <= 0:
            raise ValueError("timeout_s and block_size must be positive")
        self.url = url.rstrip("/")
        self.limits = limits
        self.timeout_s = timeout_s
        self.block_size = block_size
        self.model = model
        self.tenant_id = tenant_id
        self.overlay = MemoryIndex(limits)
        self.breaker = CircuitBreaker("KV indexer", failures_to_open=breaker_failures, open_s=breaker_open_s, logger=log)
        self._max_connections = max_connections
        self._client: httpx.AsyncClient | None = None
        self.remote_lookups = 0  # answered by the indexer
        self.fallback_lookups = 0  # answered by the overlay alone (indexer failing or skipped)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=self._max_connections, max_keepalive_connections=self._max_connections)
            self._client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, limits=limits)
        return self._client

    async def _remote(self, keys: Sequence[int]) -> PrefixMatch:
        body = _encode(
            {
                "model": self.model,
                "block_size": self.block_size,
                "tenant_id": self.tenant_id,
                "seq_hashes": list(keys),
                "holders_only": True,
            }
        )
        r = await self._http().post("/query_by_hash", content=body, headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise IndexerError(f"HTTP {r.status_code}: {r.text[:300]}")
        return parse_answer(r.content, self.tenant_id, self.block_size)

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        if not keys:
            return PrefixMatch()
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        remote = await self.breaker.call(lambda: self._remote(keys), lambda: None, timeout_s=self.timeout_s)
        local = self.overlay.match_sync(keys)
        if remote is None:
            self.fallback_lookups += 1
            return local
        self.remote_lookups += 1
        return await self._merge(keys, remote, local)

    async def _merge(self, keys: Sequence[int], remote: PrefixMatch, local: PrefixMatch) -> PrefixMatch:
        blocks = dict(remote.blocks)
        tiers = dict(remote.tiers)
        for instance, n_local in local.blocks.items():
            n_remote = blocks.get(instance, 0)
            if n_remote and not local.confirmed_blocks.get(instance):
                # confirmed by the indexer now: the guesses go (see the module docstring); an
                # overlay holding confirmed entries of its own (the gateway ingests too) keeps them
                await self.overlay.remove(instance, keys[: min(n_remote, n_local)])
            if n_local > n_remote:
                blocks[instance] = n_local
                tiers[instance] = local.tiers.get(instance, Tier.DEVICE)
        for instance, n_remote in remote.blocks.items():
            if local.blocks.get(instance, 0) < n_remote < len(keys):
                # the confirmed run ends: guesses made since may carry it on
                more = self.overlay.match_sync(keys[n_remote:]).blocks.get(instance, 0)
                if more:
                    blocks[instance] = n_remote + more
        return PrefixMatch(blocks=blocks, tiers=tiers, confirmed_blocks=dict(remote.confirmed_blocks))

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        self.overlay.insert_sync(instance, keys, tier=tier, confirmed=confirmed)

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        await self.overlay.remove(instance, keys, tier=tier)

    async def drop_instance(self, instance: str) -> None:
        await self.overlay.drop_instance(instance)

    async def apply(self, instance: str, writes: Sequence[Write]) -> None:
        self.overlay.apply_sync(instance, writes)

    async def stats(self) -> IndexStats:
        return await self.overlay.stats()

    def memory(self) -> MemoryUse:
        return self.overlay.memory()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        await self.overlay.close()
