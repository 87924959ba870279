"""IndexFeeder.on_batch: a received batch reaches the index in one call, and leaves the index and
every counter as its events did when each was written on its own (the per-event path: one
insert / remove / drop_instance per event), in both key modes, on the in-memory and the Redis index."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from adapters.index.base import KVIndex, PrefixMatch
from adapters.index.feed import IndexFeeder
from adapters.index.memory import MemoryIndex
from adapters.index.redis import RedisIndex
from adapters.kv_event_batch import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from conductor.core.block_keys import BlockKeyScheme, VllmKeys, XxhashKeys
from conductor.core.types import Tier

from .conftest import REDIS_URL, redis_available
from .redis_proc import redis_process
from .test_index_batch import SingleWrites, script_calls

BS = 16


def stored(hashes: list[int], parent: int | None, medium: str | None = "GPU") -> BlockStored:
    tokens = tuple(h * 1000 + i for h in hashes for i in range(BS))
    return BlockStored(tuple(hashes), parent, tokens, BS, medium)


def removed(hashes: list[int], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium)


# One engine step's worth of everything a batch can hold, in an order where it matters.
EVENTS: list[KVEvent] = [
    stored([1, 2, 3, 4, 5, 6], None),
    stored([7, 8], 6),  # a child of a block stored earlier in the batch
    removed([5, 6]),  # blocks stored earlier in the same batch
    stored([20, 21, 22], None, "CPU"),  # offloaded
    stored([20, 21], None),  # and on the GPU too
    removed([21], "CPU"),  # gone from DRAM only: still on the GPU
    stored([30], 999),  # a parent never seen stored: an orphan (unmapped in "xxhash" mode)
    removed([77]),  # never stored: nothing to remove
    AllBlocksCleared(),
    stored([40, 41], 8),  # the parent was known before the clear, not after
    stored([50, 51, 52], None),
    removed([52]),
    stored([60], 50),  # a parent stored earlier in the batch, after the clear
    BlockStored((70,), None, tuple(range(BS)), BS, None, None, None, 1),  # another KV cache group: skipped
]


class Recording(SingleWrites):
    """The per-event path's index: single writes only, every key it was given kept to probe with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    async def insert(self, instance: str, keys: Sequence[int], *, tier: Tier = Tier.DEVICE, confirmed: bool) -> None:
        self.seen.extend(keys)
        await super().insert(instance, keys, tier=tier, confirmed=confirmed)

    async def remove(self, instance: str, keys: Sequence[int], *, tier: Tier | None = None) -> None:
        self.seen.extend(keys)
        await super().remove(instance, keys, tier=tier)


def scheme_of(mode: str) -> BlockKeyScheme:
    return XxhashKeys(BS) if mode == "xxhash" else VllmKeys(BS, "sha256_cbor", "42")


@pytest.fixture(params=["memory", "redis"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], KVIndex]]:
    made: list[RedisIndex] = []

    def new() -> KVIndex:
        if request.param == "memory":
            return MemoryIndex()
        if not redis_available():
            pytest.fail(f"the tests need a Redis at {REDIS_URL}")
        idx = RedisIndex(REDIS_URL, prefix=f"test:feedbatch:{uuid.uuid4().hex[:12]}:", timeout_s=10, write_timeout_s=10)
        made.append(idx)
        return idx

    yield new
    for idx in made:
        await idx.clear()
        await idx.close()


def view(m: PrefixMatch) -> tuple[dict[str, int], dict[str, int], dict[str, Tier]]:
    return dict(m.blocks), dict(m.confirmed_blocks), dict(m.tiers)


@pytest.mark.parametrize("mode", ["xxhash", "vllm"])
async def test_a_batch_leaves_what_its_events_left_one_by_one(make: Callable[[], KVIndex], mode: str) -> None:
    reference = Recording()
    one_by_one = IndexFeeder(reference, scheme_of(mode), translate=mode == "xxhash")
    index = make()
    batched = IndexFeeder(index, scheme_of(mode), translate=mode == "xxhash")
    for event in EVENTS:
        await one_by_one.on_batch("w", EventBatch(1.0, (event,)))
    await batched.on_batch("w", EventBatch(1.0, tuple(EVENTS)))

    assert batched.stats == one_by_one.stats
    assert batched.instance("w") == one_by_one.instance("w")
    assert batched.map_memory() == one_by_one.map_memory()
    feed = batched.instance("w")
    # "vllm" mode stores orphans anyway (30; 40, 41 after the clear) and counts removals as sent (77)
    want = (17, 4) if mode == "xxhash" else (20, 5)
    assert (feed.stored, feed.removed, feed.cleared, feed.skipped) == (*want, 1, 1)
    # probes: every key the per-event path wrote, alone and as the chains that were stored
    keys = list(dict.fromkeys(reference.seen))
    probes = [[k] for k in keys] + [keys[i : i + 3] for i in range(len(keys))]
    got = [view(await index.match(p)) for p in probes]
    assert got == [view(await reference.match(p)) for p in probes]
    assert sum(1 for g in got if g[0]) >= 4  # what survived the clear is there: not a vacuous match
    if isinstance(index, MemoryIndex):
        assert index.confirmed_snapshot("w") == reference.inner.confirmed_snapshot("w")


@pytest.mark.parametrize("mode", ["xxhash", "vllm"])
async def test_a_received_batch_is_one_script_call(mode: str) -> None:
    with redis_process() as server:
        index = RedisIndex(server.url, prefix="test:feedrt:", timeout_s=10, write_timeout_s=10)
        feeder = IndexFeeder(index, scheme_of(mode), translate=mode == "xxhash")
        feeder.ORPHAN_CHECKS = 0  # "vllm" mode's parent look-ups are done (they read before a write)
        try:
            await feeder.on_batch("w", EventBatch(1.0, (stored([900], None),)))  # loads the script
            before = script_calls(server.port)
            await feeder.on_batch("w", EventBatch(1.0, tuple(EVENTS)))
            after = script_calls(server.port)
            assert {k: after[k] - before[k] for k in after} == {"evalsha": 1, "eval": 0, "script|load": 0}
        finally:
            await index.close()


async def test_parent_checks_see_the_writes_before_them() -> None:
    """ "vllm" mode's parent look-up (the first ORPHAN_CHECKS after a start) sees the blocks stored
    earlier in its own batch: they are written first, so a known parent is no orphan."""
    feeder = IndexFeeder(MemoryIndex(), scheme_of("vllm"), translate=False)
    await feeder.on_batch("w", EventBatch(1.0, (stored([1, 2], None), stored([3], 2), removed([3]), stored([4], 3))))
    feed = feeder.instance("w")
    assert (feed.parent_checks, feed.orphans, feed.stored, feed.removed) == (2, 1, 4, 1)
