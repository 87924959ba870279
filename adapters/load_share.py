"""Sharing in-flight load between gateway replicas.

Each replica knows exactly the work it dispatched itself (prefills queued, decode streams
running, per instance). With several replicas in front of the same workers, each must also see
the others' work, or every replica would think the cluster idle and pile onto the same instance.
A replica publishes its own in-flight work per instance to Redis every `interval_s` (one pipelined
round trip, a key that expires when the replica dies) and reads everyone else's in the same trip.
A dispatch wakes the exchange at once, and a decision may first ask for a view no older than a
few milliseconds (`refresh`): what a policy sees of other replicas is then what they had published
when it decided, or nothing at all while Redis cannot be reached (see RedisLoadShare).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Gauge

from adapters.breaker import CircuitBreaker, fail_fast_redis, register_breaker
from adapters.decision_turn import DecisionTurn
from conductor.core.types import ActiveDecode, QueuedPrefill

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger(__name__)

# instance -> (prefills as (new_tokens, cached_tokens, dispatched_at_wall_s),
#              decodes as (context_tokens, remaining_tokens, decoding))
LoadTable = dict[str, tuple[list[tuple[int, int, float]], list[tuple[int, int, bool]]]]
RemoteLoad = dict[str, tuple[tuple[QueuedPrefill, ...], tuple[ActiveDecode, ...]]]

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class LoadShare(Protocol):
    async def start(self, local: Callable[[], LoadTable]) -> None: ...

    async def close(self) -> None: ...

    def remote(self) -> RemoteLoad: ...

    def changed(self) -> None:
        """This replica's in-flight work just changed (a prefill queued or ended, a stream ended):
        share it soon rather than at the next beat."""
        ...

    async def refresh(self, max_age_s: float) -> None:
        """Make `remote()` at most `max_age_s` old where the share can (an exchange now, one for
        all concurrent callers); returns whatever happened, never raises."""
        ...

    def prefill_ends(self) -> Mapping[str, float]:
        """Per instance, when (time.monotonic()) one of the others' prefills was last seen to end."""
        ...


class NoLoadShare:
    """A single replica: nobody else's load to see."""

    async def start(self, local: Callable[[], LoadTable]) -> None:
        return None

    async def close(self) -> None:
        return None

    def remote(self) -> RemoteLoad:
        return {}

    def changed(self) -> None:
        return None

    async def refresh(self, max_age_s: float) -> None:
        return None

    def prefill_ends(self) -> Mapping[str, float]:
        return {}


class PrefillEnds:
    """When the other replicas' prefills on each instance were last seen to end.

    A replica publishes when its own queue head started: at its dispatch, or when its own previous
    prefill ended. Another replica's prefill ahead of it in the instance's FCFS queue may have held
    it back since, which its owner cannot see; merged, its head looked as if running since its
    dispatch, and the queue estimate took that whole wait off the remaining work. (The larger
    source of the replicas' TTFT error was another: prefills dispatched by other replicas in the
    last few milliseconds, not yet published; `turns` closes that, adapters/decision_turn.py.) A policy can
    bound the head's running time by the last end seen on the instance, local or remote: this is
    the remote half. An entry that leaves
    the tables between two reads ended in between; the later read's time is taken (a few ms late at
    most, which only errs towards predicting a little more work left).
    """

    KEEP_S = 60.0  # an end older than this bounds nothing any more (a prefill is shorter)

    def __init__(self) -> None:
        self._seen: dict[str, set[tuple[int, int, float]]] = {}
        self.ended_at: dict[str, float] = {}

    def update(self, tables: list[LoadTable], now_mono: float) -> None:
        current: dict[str, set[tuple[int, int, float]]] = {}
        for table in tables:
            for instance, (p_entries, _) in table.items():
                if p_entries:
                    current.setdefault(instance, set()).update((int(n), int(c), float(t)) for n, c, t in p_entries)
        for instance, before in self._seen.items():
            if not before <= current.get(instance, set()):
                self.ended_at[instance] = now_mono
        self._seen = current
        for instance in [i for i, t in self.ended_at.items() if now_mono - t > self.KEEP_S]:
            del self.ended_at[instance]


def merge_tables(tables: list[LoadTable], now_wall: float) -> RemoteLoad:
    """Other replicas' tables as the value objects a policy reads, oldest prefill first."""
    prefills: dict[str, list[tuple[int, int, float]]] = {}
    decodes: dict[str, list[ActiveDecode]] = {}
    for table in tables:
        for instance, (p_entries, d_entries) in table.items():
            prefills.setdefault(instance, []).extend(tuple(p) for p in p_entries)  # type: ignore[misc]
            decodes.setdefault(instance, []).extend(ActiveDecode(int(c), int(r), bool(d)) for c, r, d in d_entries)
    out: RemoteLoad = {}
    for instance in prefills.keys() | decodes.keys():
        queue = sorted(prefills.get(instance, []), key=lambda p: p[2])
        out[instance] = (
            # whether its replica sees its prefill end is not shared: not evidence of one (overrun.py)
            tuple(QueuedPrefill(int(n), int(c), max(0.0, now_wall - t), end_seen=False) for n, c, t in queue),
            tuple(decodes.get(instance, [])),
        )
    return out


class RedisLoadShare:
    """Replicas exchange their in-flight tables through Redis hashes that expire.

    Redis is not needed to serve: absent at start-up, hung or gone later, this replica routes on its
    own load (`remote()` empties once the last exchange is older than the tables' lifetime) and picks
    the exchange up again when Redis answers. Each exchange is bounded by `timeout_s`; after
    `failures_to_open` failures in a row the breaker skips exchanges for `open_s` at a time.
    """

    MIN_GAP_S = 0.005  # dispatch-driven exchanges: at most 200 a second per replica

    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        *,
        interval_s: float = 0.1,
        prefix: str = "conductor:load:",
        timeout_s: float = 0.2,
        failures_to_open: int = 3,
        open_s: float = 1.0,
        registry: CollectorRegistry | None = None,
        breaker: CircuitBreaker | None = None,
        turns: bool = False,
    ) -> None:
        """breaker: one made by the caller (tests: a fake clock); else one from failures_to_open and open_s.
        turns: replicas decide in turn (adapters/decision_turn.py), `refresh` taking this replica's."""
        self._url = redis_url
        self.replica_id = replica_id
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._key = f"{prefix}{replica_id}"
        self._prefix = self.prefix = prefix  # public: the lesson share keys its stream under it
        # a table outlives a few missed beats, not more: the longest a dead replica's load still counts
        self.ttl_ms = max(1000, int(interval_s * 5000))
        self._remote: RemoteLoad = {}
        self._synced_at: float | None = None  # monotonic time of the last complete exchange
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._refreshing: asyncio.Task[bool] | None = None  # the exchange decisions are waiting for
        self._ends = PrefillEnds()
        self._redis: aioredis.Redis | None = None
        self._local: Callable[[], LoadTable] = dict
        self.turn = DecisionTurn(replica_id, prefix, ttl_s=self.ttl_ms / 1000) if turns else None
        self._taking: asyncio.Task[bool] | None = None  # the take of the turn decisions are waiting for
        self._giving: asyncio.Task[bool] | None = None
        self._give_due = False  # a release is scheduled after the decisions made under this turn
        self.breaker = breaker or CircuitBreaker("load share Redis", failures_to_open=failures_to_open, open_s=open_s, logger=log)
        register_breaker(self.breaker, registry, "conductor_load_share_redis")
        self._peers = 0  # the other replicas' tables the last exchange read
        if registry is not None:
            # what the survivors count of a replica that died: its table until the key's TTL ends it
            peers = Gauge("conductor_load_share_peers", "Other replicas whose in-flight load this one sees", registry=registry)
            peers.set_function(self.peers)

    async def start(self, local: Callable[[], LoadTable]) -> None:
        self._redis = fail_fast_redis(self._url, timeout_s=self.timeout_s)
        self._local = local
        if not await self.sync():
            log.warning(
                "load sharing: Redis at %s is not reachable (%s); routing on this replica's own load until it is",
                self._url,
                self.breaker.stats.last_error,
            )
        self._task = asyncio.create_task(self._loop(), name="load-share")

    async def close(self) -> None:
        # every step bounded: a Redis that hangs must not hold up the gateway's shutdown
        for task in (self._task, self._refreshing, self._taking, self._giving):
            if task is not None:
                task.cancel()
                await asyncio.wait({task}, timeout=max(1.0, 4 * self.timeout_s))
        if self._redis is None:
            return
        # withdraw this replica's table at once rather than let it expire; skipped when Redis is down
        await self.breaker.call(self._withdraw, _false, timeout_s=self.timeout_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.aclose(), timeout=max(1.0, 4 * self.timeout_s))

    async def _withdraw(self) -> bool:
        assert self._redis is not None
        await self._redis.delete(self._key)
        await self._redis.zrem(self._prefix + "replicas", self.replica_id)
        return True

    def changed(self) -> None:
        # Replicas deciding a burst of simultaneous arrivals are blind to each other until they
        # exchange; waiting for the beat (interval_s) let all of them pile onto the same "idle"
        # instance. A dispatch wakes the exchange at once, at most one per MIN_GAP_S; so does an
        # ended prefill, or the others, fetching fresh tables before they decide, would count a
        # finished prefill as queued for up to a beat and refuse requests for a queue that is gone.
        self._wake.set()

    async def refresh(self, max_age_s: float) -> None:
        # Two replicas deciding within one beat of each other were blind to each other's dispatch
        # (up to interval_s: 100 ms); measured with three replicas, 12% of the time one prefill had
        # 2+ waiting while another had none, against 5% for one gateway. Waiting one round trip for
        # the others' tables before deciding closes that window to their own exchange's latency.
        if self.turn is not None and await self._decide_in_turn():
            return
        synced = self._synced_at
        if synced is not None and time.monotonic() - synced <= max_age_s:
            return
        task = self._refreshing
        if task is None or task.done():
            task = self._refreshing = asyncio.ensure_future(self.sync())
        # shielded: a request cancelled while waiting must not cancel the exchange others wait for;
        # sync() goes through the breaker (bounded by timeout_s, skipped while it is open)
        await asyncio.shield(task)

    async def _decide_in_turn(self) -> bool:
        """True: this replica holds the fleet's decision turn, the others' tables read as it was
        taken. False: no turn (Redis down, none within max_wait_s): decide as without turns."""
        turn = self.turn
        assert turn is not None
        if not turn.holding:
            task = self._taking
            if task is None or task.done():
                limit = turn.max_wait_s + 2 * self.timeout_s  # waiting for the turn is no failure of Redis
                task = self._taking = asyncio.ensure_future(self.breaker.call(self._take, _false, timeout_s=limit))
            await asyncio.shield(task)  # as in refresh: one take for every request waiting on it
            if not turn.holding:
                return False
        if not self._give_due:
            # the caller decides and dispatches before its next await; the callbacks queued by now
            # (requests woken by the same take) decide too; then the table is taken and published
            self._give_due = True
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self._give)
        return True

    async def _take(self) -> bool:
        assert self._redis is not None and self.turn is not None
        raw = await self.turn.take(self._redis)
        if raw is None:
            return False
        tables: list[LoadTable] = []
        for item in raw:
            try:
                tables.append(_decode(item))
            except msgspec.DecodeError as exc:
                log.debug("skipped an undecodable load table: %s", exc)
        self._remote = merge_tables(tables, time.time())
        self._synced_at = time.monotonic()
        self._ends.update(tables, self._synced_at)
        self._peers = len(tables)
        return True

    def _give(self) -> None:
        turn = self.turn
        self._give_due = False
        if turn is None or self._redis is None:  # closed meanwhile: the turn's key expires by itself
            return
        turn.holding = False
        table, redis = _encode(self._local()), self._redis
        self._giving = asyncio.ensure_future(
            self.breaker.call(lambda: _gave(turn.give(redis, table, self._key, self.ttl_ms)), _false, timeout_s=self.timeout_s)
        )

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            started = time.monotonic()
            await self.sync()
            gap = self.MIN_GAP_S - (time.monotonic() - started)
            if gap > 0:
                await asyncio.sleep(gap)  # dispatches meanwhile coalesce into the next exchange

    async def sync(self) -> bool:
        """One exchange through the breaker: True when it happened, False when it failed or was skipped."""
        return await self.breaker.call(self._sync_ok, _false, timeout_s=self.timeout_s)

    async def _sync_ok(self) -> bool:
        await self.sync_once()
        return True

    async def sync_once(self) -> None:
        """One exchange, raising what Redis raises: publish ours, read everyone else's."""
        r = self._redis
        assert r is not None
        ttl_ms = self.ttl_ms
        now = time.time()
        members = self._prefix + "replicas"
        async with r.pipeline(transaction=False) as pipe:
            pipe.set(self._key, _encode(self._local()), px=ttl_ms)
            pipe.zadd(members, {self.replica_id: now})
            pipe.zremrangebyscore(members, "-inf", now - ttl_ms / 1000)  # replicas that stopped beating
            pipe.zrange(members, 0, -1)
            *_, replicas = await pipe.execute()
        others = [self._prefix + m.decode() for m in replicas if m.decode() != self.replica_id]
        tables: list[LoadTable] = []
        if others:
            for raw in await r.mget(others):
                if not raw or not isinstance(raw, bytes):  # gone since the member list was read
                    continue
                try:
                    tables.append(_decode(raw))
                except msgspec.DecodeError as exc:  # one replica's bad table is not Redis failing
                    log.debug("skipped an undecodable load table: %s", exc)
        self._remote = merge_tables(tables, time.time())
        self._synced_at = time.monotonic()
        self._ends.update(tables, self._synced_at)
        self._peers = len(tables)

    def prefill_ends(self) -> Mapping[str, float]:
        return self._ends.ended_at

    def peers(self) -> int:
        """The other replicas whose tables `remote()` holds now (none once the view is too old)."""
        synced = self._synced_at
        return self._peers if synced is not None and time.monotonic() - synced <= self.ttl_ms / 1000 else 0

    def remote(self) -> RemoteLoad:
        synced = self._synced_at
        age = time.monotonic() - synced if synced is not None else 0.0
        if synced is None or age > self.ttl_ms / 1000:
            return {}  # too old to trust (Redis down): route on our own load alone
        # elapsed_s was measured at the exchange; the prefills have run on since (up to an interval,
        # a large share of a prefill), and a frozen elapsed_s overstates what is left of the head
        return {
            instance: (tuple(QueuedPrefill(q.new_tokens, q.cached_tokens, q.elapsed_s + age, q.end_seen) for q in queue), decodes)
            if queue
            else (queue, decodes)
            for instance, (queue, decodes) in self._remote.items()
        }


def _false() -> bool:
    return False


async def _gave(giving: Awaitable[None]) -> bool:
    await giving
    return True


def local_table(states: Mapping[str, object]) -> LoadTable:
    """This replica's own in-flight work, in the shape it is published."""
    out: LoadTable = {}
    now_mono, now_wall = time.monotonic(), time.time()
    for name, state in states.items():
        prefills = [
            (p.new_tokens, p.cached_tokens, now_wall - (now_mono - state.started[rid]))  # type: ignore[attr-defined]
            for rid, p in state.prefills.items()  # type: ignore[attr-defined]
        ]
        decodes = [(d.context_tokens, d.remaining_tokens, d.decoding) for d in state.decodes.values()]  # type: ignore[attr-defined]
        if prefills or decodes:
            out[name] = (prefills, decodes)
    return out
