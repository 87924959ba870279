"""The shared cache index on a Redis Cluster: RedisIndex's semantics, sharded over the cluster's nodes.

Layout. A Lua script may only touch keys of one slot, so the index is cut into a fixed number of
shards (`shards`, default 16; every gateway replica must use the same number), each under its own
hash tag T = "{<prefix>s<k>}". An instance lives wholly in shard crc32(instance) % shards:
T i:<inst> (its blocks), T l:<inst> (its LRU order), plus the shard's T instances, T clock and
T evictions (redis_cluster_scripts.py lists them). Instance-major, as in RedisIndex, because the
question a look-up asks is per instance ("how long a leading run of these blocks do you hold?"):
inside one shard a script answers it for all of the shard's instances with an early stop (HEXISTS
on the head block; for a holder, a bisection with HEXISTS for where its run ends, then HMGET of
that range in growing chunks, so a run of r blocks reads r fields plus ~log2(B) probes), where a
block-major layout would scatter one instance's run over every node and lose that early stop.
The shards' slots spread over the masters, so different instances' data sit on different nodes.

Round trips, for a prompt of B blocks, H instances holding its head block and M masters:
- match: ONE round: one script per master, answering for all the shards it serves (the client's
  slot map groups them; min(shards, M) scripts, all nodes in parallel), independent of B and H; the
  packed keys travel once per master. A node that no longer serves a listed shard fails the call
  (never skips the shard) and those shards are asked again one script each. Server work is
  O(instances + sum over the H holders of their matched run), split over the masters.
- insert / remove / drop_instance, and `apply` (a whole event batch of one instance: its stores,
  removals and clears in order): one script on one node, whatever B, since an instance lives in one
  shard. Once a second (at most) a call that inserts is preceded by one extra round of `shards`
  SCARDs that refreshes the instance count.
- stats: one round of `shards` scripts. Version check: one round to the masters, at first use.

Cap. A shared LRU needs one counter for the whole cluster, which a one-slot script cannot touch.
So each instance keeps a fair share: at most floor(max_blocks / n) entries (at least 1), n = the
instances registered in all shards, as this client saw them (its own shard exactly, the others as
of its last refresh, at most 1 s old). While the instance set is stable the total therefore stays
<= max_blocks; when instances join, each older instance shrinks to its new share at its next
insert, so the total stays <= sum over instances of max_blocks / n_i (n_i: the count seen at that
instance's last insert). Within an instance the oldest touches are evicted first, heads of
prompts last (counted in stats().evictions). Unlike the single-node index, an idle instance's
unused share is not lent to a busy one.

Expiry. Dispatch guesses carry their expiry (Redis's own clock, TIME) in the value, as in
RedisIndex, and a look-up ignores expired ones. On Redis 7.4+ (HPEXPIRE: per-field TTL, detected
from the masters' redis_version at first use and logged once) each guess field also gets a TTL, so
its memory is freed on time; a confirming event HPERSISTs it. Older servers (7.0 here and in CI)
keep an expired guess until it is overwritten, evicted, removed, or its instance's keys expire after
key_ttl_s without inserts; LRU members whose field expired leave through the cap like any other.
"""

from __future__ import annotations

import hashlib
import logging
import time
import zlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.exceptions import NoScriptError, ResponseError, SlotNotCoveredError

from adapters.index import redis_cluster_scripts as lua
from adapters.index.base import (
    GUESS,
    STORE,
    IndexLimits,
    IndexStats,
    PrefixMatch,
    SingleWritesByApply,
    Write,
)
from adapters.index.redis import CALLS_IN_FLIGHT, CallGate, match_from_replies, pack_keys, pack_writes

log = logging.getLogger(__name__)

DEFAULT_SHARDS = 16
COUNT_REFRESH_S = 1.0  # how stale this client's view of other shards' instance counts may get
_HEXPIRE_VERSION = (7, 4)


def startup_nodes(urls: str | Sequence[str]) -> tuple[list[ClusterNode], dict[str, Any]]:
    """ClusterNodes from "redis://h:p" URLs (a list, or one comma-separated string), and the
    credentials/TLS the first URL carries (one cluster has one password)."""
    items = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else [u.strip() for u in urls]
    parsed = [urlparse(u if "://" in u else f"redis://{u}") for u in items if u]
    if not parsed:
        raise ValueError("a Redis Cluster index needs at least one startup node URL")
    nodes = [ClusterNode(p.hostname or "127.0.0.1", p.port or 6379) for p in parsed]
    first = parsed[0]
    extra: dict[str, Any] = {"ssl": first.scheme == "rediss"}
    if first.username:
        extra["username"] = unquote(first.username)
    if first.password:
        extra["password"] = unquote(first.password)
    return nodes, extra


def _cluster_client(urls: str | Sequence[str], timeout_s: float) -> RedisCluster:
    nodes, extra = startup_nodes(urls)
    # One retry, no back-off: enough to re-read the slot map after a failover; the breaker above
    # (GuardedIndex) decides about anything longer than that.
    return RedisCluster(
        startup_nodes=nodes, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1), **extra
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _version(raw: Any) -> tuple[int, int]:
    parts = [*_text(raw).split("."), "0", "0"][:2]
    return int(parts[0]), int(parts[1])


class RedisClusterIndex(SingleWritesByApply):
    """KVIndex on a Redis Cluster. `prefix` isolates deployments (and tests) on one cluster."""

    def __init__(
        self,
        urls: str | Sequence[str] = "redis://127.0.0.1:7000",
        *,
        prefix: str = "conductor:kv:",
        limits: IndexLimits | None = None,
        timeout_s: float = 0.5,
        write_timeout_s: float = 2.0,
        shards: int = DEFAULT_SHARDS,
    ) -> None:
        """urls: startup node(s); the client learns the rest of the cluster from them. timeout_s
        bounds a look-up, write_timeout_s the writes (two clients, so a slow write never holds a
        look-up's connection). Nothing connects before the first call."""
        if "{" in prefix or "}" in prefix:
            raise ValueError("the index prefix may not contain braces: they would change the hash tags")
        if shards <= 0:
            raise ValueError("shards must be positive")
        self.limits = limits or IndexLimits()
        self.prefix = prefix
        self.shards = shards
        self._read = _cluster_client(urls, timeout_s)
        self._write = _cluster_client(urls, write_timeout_s)
        # CALLS_IN_FLIGHT per client, the rest waiting their turn: a call holds at most one
        # connection per node, and redis-py's cluster client fails a call past 100 connections to a
        # node (MaxConnectionsError) where it could wait; hundreds of feeds writing at once did that
        self._gates = {
            id(self._read): CallGate(CALLS_IN_FLIGHT, timeout_s),
            id(self._write): CallGate(CALLS_IN_FLIGHT, write_timeout_s),
        }
        self._tags = [f"{{{prefix}s{k}}}" for k in range(shards)]
        self._slots = [key_slot(t.encode()) for t in self._tags]
        self._sha = {name: _sha1(src) for name, src in self._scripts().items()}
        self._hexpire: bool | None = None  # unknown until the first call reads the servers' version
        self._counts = [0] * shards  # instances per shard, as last seen
        self._counts_at = -COUNT_REFRESH_S * 2

    @staticmethod
    def _scripts() -> dict[str, str]:
        return {
            "apply": lua.APPLY,
            "stats": lua.STATS,
            "match": lua.MATCH,
            "clear": lua.CLEAR,
        }

    def shard_of(self, instance: str) -> int:
        """The shard an instance's keys live in (stable across processes: crc32, not hash())."""
        return zlib.crc32(instance.encode()) % self.shards

    def tag(self, shard: int) -> str:
        return self._tags[shard]

    async def apply(self, instance: str, writes: Sequence[Write]) -> None:
        """All of `writes`, in order, in one script on the node serving the instance's shard."""
        blob, spec = pack_writes(writes)
        if not spec:
            return
        shard = self.shard_of(instance)
        inserts = any(spec[i] in (STORE, GUESS) for i in range(0, len(spec), 3))
        # what only an insert needs: the server version (per-field TTLs) and the others' counts (cap)
        hexpire = await self._uses_hexpire() if inserts else False
        if inserts and time.monotonic() - self._counts_at > COUNT_REFRESH_S:
            await self._refresh_counts()
        others = sum(self._counts) - self._counts[shard]
        t = self._tags[shard]
        limits = self.limits
        args: list[Any] = [
            instance,
            int(limits.unconfirmed_ttl_s * 1000),
            int(limits.key_ttl_s * 1000),
            limits.max_blocks,
            others,
            1 if hexpire else 0,
            blob,
            *spec,
        ]
        keys = [f"{t}instances", f"{t}clock", f"{t}evictions", f"{t}i:{instance}", f"{t}l:{instance}"]
        members, _ = await self._eval(self._write, "apply", keys, args)
        self._counts[shard] = int(members)

    async def match(self, keys: Sequence[int]) -> PrefixMatch:
        if not keys:
            return PrefixMatch()
        blob = pack_keys(keys)
        groups = await self.node_groups()
        calls = [([f"{self._tags[g[0]]}instances"], [blob, *(self._tags[s] for s in g)]) for g in groups]
        replies = await self._eval_each(self._read, "match", calls, strict=False)
        answers: list[Any] = []
        again: list[int] = []
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, ResponseError):
                again.extend(group)  # a shard not on that node (stale slot map, migration): ask per shard
            elif isinstance(reply, Exception):
                raise reply
            else:
                answers.append(reply)
        if again:
            # one call per shard is routed by its own key, so redis-py follows MOVED / ASK (and
            # refreshes its slot map, which regroups the next look-ups)
            per_shard = [([f"{self._tags[s]}instances"], [blob, self._tags[s]]) for s in again]
            answers.extend(await self._eval_each(self._read, "match", per_shard))
        return match_from_replies(answers)

    async def node_groups(self) -> list[list[int]]:
        """The shards grouped by the master serving them, as the read client's slot map says now:
        a look-up sends one script per group. Every shard is in exactly one group."""
        await self._read.initialize()  # returns at once once the slot map is loaded
        by_node: dict[str, list[int]] = {}
        try:
            for shard, slot in enumerate(self._slots):
                by_node.setdefault(self._read.nodes_manager.get_node_from_slot(slot).name, []).append(shard)
        except SlotNotCoveredError:
            return [[s] for s in range(self.shards)]  # no map to group by: per shard, redis-py routes
        return list(by_node.values())

    async def stats(self) -> IndexStats:
        replies = await self._eval_each(self._write, "stats", [([f"{t}instances", f"{t}evictions"], [t]) for t in self._tags])
        names: list[str] = []
        blocks = evictions = 0
        for shard, raw in enumerate(replies):
            evictions += int(raw[0])
            blocks += int(raw[1])
            mine = [_text(n) for n in raw[2:]]
            self._counts[shard] = len(mine)
            names.extend(mine)
        self._counts_at = time.monotonic()
        return IndexStats(blocks=blocks, evictions=evictions, instances=tuple(sorted(names)))

    async def clear(self) -> int:
        """Delete every key of this index (tests, an operator's reset); returns how many existed."""
        replies = await self._eval_each(
            self._write, "clear", [([f"{t}instances", f"{t}clock", f"{t}evictions"], [t]) for t in self._tags]
        )
        self._counts = [0] * self.shards
        return sum(int(r) for r in replies)

    async def close(self) -> None:
        await self._read.aclose()
        await self._write.aclose()

    async def _uses_hexpire(self) -> bool:
        if self._hexpire is None:
            async with self._gates[id(self._write)]:
                infos = await self._write.info("server", target_nodes=RedisCluster.PRIMARIES)
            found = [info["redis_version"] for info in _per_node(infos)]
            oldest = min((_version(v) for v in found), default=(0, 0))
            self._hexpire = oldest >= _HEXPIRE_VERSION
            log.info(
                "KV index on Redis Cluster: servers run %s; unconfirmed entries expire by %s",
                ", ".join(sorted(set(map(_text, found)))),
                "per-field TTL (HPEXPIRE)"
                if self._hexpire
                else "the expiry kept in their value (no HPEXPIRE before Redis 7.4; they stay until "
                "overwritten, evicted or their instance's keys expire)",
            )
        return self._hexpire

    async def _refresh_counts(self) -> None:
        async with self._gates[id(self._write)], self._write.pipeline() as pipe:
            for t in self._tags:
                pipe.scard(f"{t}instances")
            counts = await pipe.execute()
        self._counts = [int(c) for c in counts]
        self._counts_at = time.monotonic()

    async def _eval(self, client: RedisCluster, script: str, keys: list[str], args: list[Any]) -> Any:
        async with self._gates[id(client)]:
            try:
                return await client.execute_command("EVALSHA", self._sha[script], len(keys), *keys, *args)
            except NoScriptError:
                # a node that never ran it (new, or a replica promoted by a failover): send the source once
                return await client.execute_command("EVAL", self._scripts()[script], len(keys), *keys, *args)

    async def _eval_each(
        self, client: RedisCluster, script: str, calls: list[tuple[list[str], list[Any]]], *, strict: bool = True
    ) -> list[Any]:
        """One script per (keys, args), one pipeline per node, nodes in parallel (redis-py's cluster
        pipeline groups by node and gathers); scripts a node lacks are sent again as EVAL. strict:
        raise the first error; otherwise errors are returned in their call's place."""
        async with self._gates[id(client)]:
            return await self._pipelined(client, script, calls, strict=strict)

    async def _pipelined(
        self, client: RedisCluster, script: str, calls: list[tuple[list[str], list[Any]]], *, strict: bool
    ) -> list[Any]:
        async with client.pipeline() as pipe:
            for keys, args in calls:
                pipe.execute_command("EVALSHA", self._sha[script], len(keys), *keys, *args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            source = self._scripts()[script]
            async with client.pipeline() as pipe:
                for i in missing:
                    keys, args = calls[i]
                    pipe.execute_command("EVAL", source, len(keys), *keys, *args)
                for i, reply in zip(missing, await pipe.execute(raise_on_error=False), strict=True):
                    replies[i] = reply
        for reply in replies:
            if strict and isinstance(reply, Exception):
                raise reply
        return replies


def _sha1(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()  # Redis names scripts by SHA-1


def _per_node(infos: Any) -> list[dict[str, Any]]:
    """redis-py answers INFO on several nodes as {node: info}, on one node as the info itself."""
    if isinstance(infos, dict) and "redis_version" in infos:
        return [infos]
    return [v for v in infos.values() if isinstance(v, dict)] if isinstance(infos, dict) else []
