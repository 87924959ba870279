"""The engine in-process (no HTTP): continuous batching, FCFS admission, the running batch limit."""

from __future__ import annotations

import asyncio
import dataclasses

from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.metrics import EngineMetrics
from adapters.emulator.prefix_cache import PrefixCache
from adapters.emulator.profile import Profile
from conductor.core.vllm_hash import VllmBlockHasher

# Every step costs 1 ms, so the tests measure steps, not wall time.
FAST = Profile(
    prefill_base_s=0.001,
    prefill_per_token_s=0.0,
    prefill_quad_s=0.0,
    decode_base_s=0.001,
    decode_per_seq_s=0.0,
    decode_per_kv_token_s=0.0,
)


def engine(profile: Profile = FAST) -> Engine:
    return Engine(profile, VllmBlockHasher("sha256", 16, seed="x"), PrefixCache(16, 10_000), EngineMetrics("m"))


async def drain(seq: Sequence) -> list[int]:
    out = []
    while (k := await seq.tokens.get()) is not None:
        out.append(k)
    return out


async def test_decodes_batch_and_prefills_join_at_step_boundaries() -> None:
    eng = engine()
    eng.start()
    try:
        seqs = [eng.submit(f"r{i}", [i] * 20, 10) for i in range(4)]
        results = await asyncio.gather(*(drain(s) for s in seqs))
    finally:
        await eng.stop()
    assert all(r == list(range(10)) for r in results)
    # FCFS: one prefill per step (each also advancing the running batch), then shared decode steps:
    # the 4th sequence is prefilled at step 4 and needs 9 more -> 13 steps; one at a time would be 40.
    assert eng.steps == 13
    first = [s.first_token_at or 0.0 for s in seqs]
    assert first == sorted(first)


async def test_running_batch_limit_queues_the_rest() -> None:
    eng = engine(dataclasses.replace(FAST, max_num_seqs=2))
    eng.start()
    try:
        seqs = [eng.submit(f"r{i}", [i] * 20, 5) for i in range(3)]
        await asyncio.gather(*(drain(s) for s in seqs))
    finally:
        await eng.stop()
    # The third waits until a slot frees: it is scheduled only after the first finished.
    assert seqs[2].scheduled_at is not None and seqs[0].last_token_at is not None
    assert seqs[2].scheduled_at >= seqs[0].last_token_at


async def test_abort_frees_the_slot_and_ends_the_stream() -> None:
    eng = engine()
    eng.start()
    try:
        seq = eng.submit("long", [1] * 40, 10_000)
        assert await seq.tokens.get() == 0
        eng.abort(seq)
        rest = await drain(seq)
        assert len(rest) < 10_000 and seq.aborted
        assert eng.running == [] and eng.cache.used_blocks == 0
    finally:
        await eng.stop()


async def test_priority_scheduling_takes_the_lowest_priority_first_fcfs_ignores_it() -> None:
    # four requests arrive together, the last with priority -1 (a staging request)
    order = {}
    for policy in ("fcfs", "priority"):
        eng = Engine(
            FAST, VllmBlockHasher("sha256", 16, seed="x"), PrefixCache(16, 10_000), EngineMetrics("m"), scheduling_policy=policy
        )
        eng.start()
        try:
            seqs = [eng.submit(f"r{i}", [i] * 20, 1, priority=-1 if i == 3 else 0) for i in range(4)]
            await asyncio.gather(*(drain(s) for s in seqs))
        finally:
            await eng.stop()
        order[policy] = [s.request_id for s in sorted(seqs, key=lambda s: s.scheduled_at or 0.0)]
    assert order["fcfs"] == ["r0", "r1", "r2", "r3"]
    # all four are waiting when the loop first steps (submitted without a pause): the lowest
    # priority goes first, the rest in arrival order
    assert order["priority"] == ["r3", "r0", "r1", "r2"]
