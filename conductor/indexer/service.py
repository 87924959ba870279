"""`conductor indexer`: one process that ingests every worker's KV events and answers cache look-ups.

Gateway replicas (and other routers) ask it where a prompt's blocks live instead of each subscribing
to every worker (`adapters/index/remote.py` is the gateway's client). It reads the gateway's own
settings (one config file serves both): every prefill/mixed instance with a `kv_events_endpoint`
(data-parallel ranks included) gets an `EventSubscriber` (ZMQ SUB, gaps repaired from the worker's
replay socket), one `IndexFeeder` turns the events into keys of the configured `kv.key_mode`, and
the index `make_index` builds holds them (`kv.index` memory, redis or redis_cluster; `kv.index: indexer`, meant
for the gateways, means memory here: an indexer never asks itself). The HTTP side, in the shape of
Mooncake's RFC 1403, is `conductor/indexer/api.py`.

Holders. The index keeps each (feed, tier) as a holder of its own, named "<feed>|<tier>", where a
feed is an instance ("prefill-0") or, with data_parallel_size > 1, one rank of it ("prefill-0#dp1").
So a look-up can say how many leading tokens each medium and each DP rank holds, as the RFC's
answer wants, from one index match; a block both in HBM and offloaded to DRAM is two entries. The
feeder sees feeds, not holders (`TieredHolders` folds its look-ups back), so its per-feed maps and
resyncs are per rank: a gap on rank 1 forgets rank 1 only. Gateways that read a Redis index the
indexer writes would see these holder names: with an indexer, gateways read through its HTTP API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adapters.index.base import IndexLimits, IndexStats, KVIndex, MemoryUse, PrefixMatch
from adapters.index.feed import IndexFeeder, mapped_within
from adapters.index.metrics import register_kv_memory
from adapters.kv_events import EventBatch, EventSource, EventSubscriber, offset_endpoint
from conductor.config.settings import Settings
from conductor.core.block_keys import BlockKeyScheme, make_scheme
from conductor.core.errors import ConfigError
from conductor.core.types import Role, Tier
from conductor.kv.event_metrics import KVEventsCollector
from conductor.kv.index_factory import make_index
from conductor.ops.gc_freeze import GcFreezer

log = logging.getLogger(__name__)

_TIERS = tuple(Tier)
READY_PROBE_TIMEOUT_S = 0.5


def holder_name(feed: str, tier: Tier) -> str:
    return f"{feed}|{tier.value}"


def split_holder(name: str) -> tuple[str, Tier] | None:
    """(feed, tier) of a holder name, None for a name the indexer did not write."""
    feed, sep, tier = name.rpartition("|")
    if not sep:
        return None
    try:
        return feed, Tier(tier)
    except ValueError:
        return None


class TieredHolders:
    """A KVIndex over feeds that stores each (feed, tier) as its own holder in `inner`.

    Writes name feeds (what the feeder and the subscribers know); `match` folds holders back to
    feeds (the longest run among a feed's tiers) so the feeder's checks work unchanged;
    `match_holders` gives the raw per-tier runs the query answers are built from.
    """

    def __init__(self, inner: KVIndex) -> None:
        self.inner = inner
        self.limits: IndexLimits = inner.limits

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        await self.inner.insert(holder_name(instance, tier), keys, tier=tier, confirmed=confirmed)

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        for t in _TIERS if tier is None else (tier,):
            await self.inner.remove(holder_name(instance, t), keys, tier=t)

    async def drop_instance(self, instance: str) -> None:
        for t in _TIERS:
            await self.inner.drop_instance(holder_name(instance, t))

    async def match_holders(self, keys: Sequence[int]) -> PrefixMatch:
        return await self.inner.match(keys)

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        raw = await self.inner.match(keys)
        blocks: dict[str, int] = {}
        tiers: dict[str, Tier] = {}
        confirmed: dict[str, int] = {}
        for name, n in raw.blocks.items():
            parsed = split_holder(name)
            if parsed is None:
                continue
            feed, tier = parsed
            if n > blocks.get(feed, 0):
                blocks[feed], tiers[feed] = n, tier
            confirmed[feed] = max(confirmed.get(feed, 0), raw.confirmed_blocks.get(name, 0))
        return PrefixMatch(blocks=blocks, tiers=tiers, confirmed_blocks={k: v for k, v in confirmed.items() if v})

    async def stats(self) -> IndexStats:
        return await self.inner.stats()

    def memory(self) -> MemoryUse | None:
        memory: Callable[[], MemoryUse | None] | None = getattr(self.inner, "memory", None)
        return memory() if memory is not None else None

    async def close(self) -> None:
        await self.inner.close()


@dataclass(frozen=True, slots=True)
class Feed:
    """One subscribed event stream: the feed name used in the index, its instance and DP rank."""

    name: str
    instance: str
    rank: int


@dataclass(frozen=True, slots=True)
class FeedStatus:
    """What /ready says about one feed: `reason` is None when the feed is fine."""

    feed: Feed
    endpoint: str
    batches: int
    last_seq: int | None
    reason: str | None


class IndexerMetrics:
    """The indexer's own series (the feeds' are `conductor_kv_events_*`, the memory `conductor_kv_memory_*`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "conductor_indexer_events_ingested", "KV events applied to the index (all kinds)", registry=registry
        )
        self.block_events = Counter(
            "conductor_indexer_block_events_ingested",
            "Blocks named by applied BlockStored / BlockRemoved events",
            ["kind"],
            registry=registry,
        )
        self.blocks_held = Gauge("conductor_indexer_blocks_held", "Entries the index holds (block x holder)", registry=registry)
        self.lookups = Counter("conductor_indexer_lookups", "Cache look-ups answered", ["route", "outcome"], registry=registry)
        self.lookup_seconds = Histogram(
            "conductor_indexer_lookup_seconds",
            "Time to answer a look-up, body read to answer encoded",
            ["route"],
            registry=registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )


class IndexerService:
    """The index, its feeder and one subscriber per feed, built from the gateway's settings.

    Call `start()` inside the serving loop and `close()` at shutdown. `answer` and `ready` are what
    the HTTP routes call.
    """

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None) -> None:
        from conductor.config.derived import kv_settings  # the gateway's own reading of `kv` (block size, endpoints)

        kv = kv_settings(settings)
        if kv.index == "indexer":  # the gateways' setting in a shared config file: never ask ourselves
            kv = kv.model_copy(update={"index": "memory"})
        self.settings = settings
        self.models = frozenset(settings.models)
        self.registry = registry or CollectorRegistry()
        self.metrics = IndexerMetrics(self.registry)
        self.scheme: BlockKeyScheme = make_scheme(
            kv.key_mode, kv.block_size, seed=kv.hash_seed, algo=kv.vllm_hash_algo, vllm_seed=kv.vllm_hash_seed
        )
        self.index = TieredHolders(make_index(kv, self.registry))
        self.feeder = IndexFeeder(
            self.index,
            self.scheme,
            translate=kv.key_mode == "xxhash",
            max_mapped_per_instance=mapped_within(kv.hash_map_memory_bytes_per_instance),
        )
        register_kv_memory(self.registry, self.index.memory, self.feeder.map_memory)
        specs = {spec.name: spec for spec in settings.instances()}
        unknown = sorted(set(kv.kv_events) - set(specs))
        if unknown:
            raise ConfigError(f"kv.kv_events names unknown instances: {unknown}")
        self._ctx = zmq.asyncio.Context()
        self.feeds: dict[str, Feed] = {}
        self.subscribers: list[EventSubscriber] = []
        for iid, ep in kv.kv_events.items():
            spec = specs[iid]
            if spec.role is Role.DECODE:
                continue  # routing asks about prefill caches; decode instances are not looked up
            for rank in range(ep.data_parallel_size):
                feed = Feed(iid if ep.data_parallel_size == 1 else f"{iid}#dp{rank}", iid, rank)
                self.feeds[feed.name] = feed
                replay = None if ep.replay_endpoint is None else offset_endpoint(ep.replay_endpoint, rank)
                source = EventSource.for_instance(feed.name, spec.url, offset_endpoint(ep.endpoint, rank), replay, ep.topic, rank)
                self.subscribers.append(
                    EventSubscriber(
                        source,
                        self._on_batch,
                        self.feeder.on_resync,
                        context=self._ctx,
                        replay_timeout_s=kv.replay_timeout_s,
                        catch_up=kv.replay_on_start,
                        **kv.event_bounds(),
                    )
                )
        if not self.subscribers:
            self._ctx.destroy(linger=0)
            raise ConfigError("no KV event feeds: give prefill/mixed instances a kv_events_endpoint (or kv.kv_events)")
        # every tracked instance with its ranks, in configuration order (the answers list them all)
        self.instances: dict[str, tuple[int, ...]] = {}
        for feed in self.feeds.values():
            self.instances[feed.instance] = (*self.instances.get(feed.instance, ()), feed.rank)
        self.registry.register(KVEventsCollector(self.subscribers, self.feeder, list(self.feeds)))
        self._started = False
        self.gc_freezer = GcFreezer(settings.gc_freeze_interval_s)  # the index's p99 (conductor/ops/gc_freeze.py)

    @property
    def block_size(self) -> int:
        return self.scheme.block_size

    async def start(self) -> None:
        # all at once: each may wait up to replay_timeout_s for its worker's replay buffer
        await asyncio.gather(*(sub.start() for sub in self.subscribers))
        self.gc_freezer.start()
        self._started = True
        log.info(
            "indexer: %d feeds from %d instances, %d-token blocks, %s keys",
            len(self.subscribers),
            len(self.instances),
            self.block_size,
            "xxhash" if self.feeder.translate else "vllm",
        )

    async def close(self) -> None:
        await self.gc_freezer.close()
        for sub in self.subscribers:
            await sub.close()
        await self.index.close()
        self._ctx.destroy(linger=0)

    async def _on_batch(self, feed: str, batch: EventBatch) -> None:
        before = self.feeder.stats
        await self.feeder.on_batch(feed, batch)
        after = self.feeder.stats
        self.metrics.events.inc(len(batch.events))
        if after.stored != before.stored:
            self.metrics.block_events.labels("stored").inc(after.stored - before.stored)
        if after.removed != before.removed:
            self.metrics.block_events.labels("removed").inc(after.removed - before.removed)

    async def refresh_gauges(self) -> None:
        """Before a scrape: the entries held (a Redis index answers asynchronously)."""
        try:
            stats = await asyncio.wait_for(self.index.stats(), 1.0)
        except Exception as exc:  # noqa: BLE001  # a scrape must not fail because Redis is slow
            log.debug("index stats unavailable: %r", exc)
            return
        self.metrics.blocks_held.set(stats.blocks)

    async def match(self, keys: Sequence[int], *, holders_only: bool = False) -> dict[str, dict[str, object]]:
        """Per tracked instance (only those holding a run, with `holders_only`), the RFC 1403 entry for
        the leading run of `keys`: {"longest_matched", "GPU", "CPU", "DISK", "DP": {rank: tokens}}, in tokens."""
        raw = await self.index.match_holders(keys) if keys else PrefixMatch()
        size = self.block_size
        per_tier: dict[str, dict[Tier, int]] = {}
        per_rank: dict[str, dict[int, int]] = {}
        for name, n in raw.blocks.items():
            parsed = split_holder(name)
            feed = self.feeds.get(parsed[0]) if parsed is not None else None
            if parsed is None or feed is None:
                continue  # an entry of something else sharing the index
            tiers = per_tier.setdefault(feed.instance, {})
            ranks = per_rank.setdefault(feed.instance, dict.fromkeys(self.instances[feed.instance], 0))
            tiers[parsed[1]] = max(tiers.get(parsed[1], 0), n)
            ranks[feed.rank] = max(ranks[feed.rank], n)
        out: dict[str, dict[str, object]] = {}
        for iid in per_rank if holders_only else self.instances:
            if iid not in per_rank:  # holds nothing: every rank at 0
                per_tier[iid], per_rank[iid] = {}, dict.fromkeys(self.instances[iid], 0)
            tiers, ranks = per_tier[iid], per_rank[iid]
            out[iid] = {
                "longest_matched": max(ranks.values(), default=0) * size,
                "GPU": tiers.get(Tier.DEVICE, 0) * size,
                "CPU": tiers.get(Tier.HOST, 0) * size,
                "DISK": tiers.get(Tier.STORE, 0) * size,
                "DP": {str(rank): n * size for rank, n in sorted(ranks.items())},
            }
        return out

    async def ready(self) -> list[FeedStatus]:
        """Every feed's state; a feed with a `reason` keeps the indexer from being ready."""
        checks = await asyncio.gather(*(self._reachable(sub) for sub in self.subscribers))
        out = []
        for sub, unreachable in zip(self.subscribers, checks, strict=True):
            st = sub.stats
            reason = "not started" if not self._started else unreachable
            out.append(FeedStatus(self.feeds[sub.source.instance], sub.address, st.batches, st.last_seq, reason))
        return out

    async def _reachable(self, sub: EventSubscriber) -> str | None:
        """Why the worker's PUB socket cannot be reached, or None. ZMQ connects in the background and
        never says it failed, so a TCP connection is tried to the address the SUB socket connects to."""
        if sub.binds:
            return None  # the worker connects to us: our bound socket is all there is to check
        parts = urlsplit(sub.address)
        if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
            return None  # ipc / inproc: nothing to probe from here
        started = time.monotonic()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), READY_PROBE_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            return f"KV events publisher {sub.address} unreachable after {time.monotonic() - started:.2f}s: {exc!r}"
        writer.close()
        return None
