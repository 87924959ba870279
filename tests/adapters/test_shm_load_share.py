"""Worker processes of one gateway see each other's in-flight work through shared memory: tested
across real processes (spawned, as the supervisor spawns them)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import pytest

from adapters.load_share import LoadTable
from adapters.shm_load_share import SharedMemoryLoadShare, create_segment, slot_written
from tests.support.waiting import wait_for

SLOT_BYTES = 4096


def _sibling(segment: str, table: LoadTable, stop: Event, slot_bytes: int) -> None:
    """Another worker: publishes `table` from slot 1 until told to stop, then leaves cleanly."""

    async def main() -> None:
        share = SharedMemoryLoadShare(segment, 1, 2, slot_bytes=slot_bytes, interval_s=0.01)
        await share.start(lambda: table)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await share.close()

    asyncio.run(main())


def _spawn(segment: str, table: LoadTable, stop: Event, slot_bytes: int = SLOT_BYTES) -> BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(target=_sibling, args=(segment, table, stop, slot_bytes))
    proc.start()
    return proc


@pytest.fixture
def segment() -> Iterator[SharedMemory]:
    shm = create_segment(2, SLOT_BYTES)
    yield shm
    shm.close()
    shm.unlink()


async def test_a_sibling_process_sees_queued_prefills_and_decodes(segment: SharedMemory) -> None:
    table: LoadTable = {"prefill-0": ([(4096, 0, 1.0e9), (512, 256, 1.0e9 + 1)], []), "decode-1": ([], [(1000, 200, True)])}
    stop = multiprocessing.get_context("spawn").Event()
    me = SharedMemoryLoadShare(segment.name, 0, 2, slot_bytes=SLOT_BYTES)
    await me.start(dict)
    proc = _spawn(segment.name, table, stop)
    try:
        assert await _until(lambda: "prefill-0" in me.remote())
        queue, _ = me.remote()["prefill-0"]
        assert [(p.new_tokens, p.cached_tokens) for p in queue] == [(4096, 0), (512, 256)]
        assert queue[0].elapsed_s > queue[1].elapsed_s  # dispatched first: the running head
        assert me.remote()["decode-1"][1][0].context_tokens == 1000
    finally:
        stop.set()
        proc.join(30)
    # a sibling that stops clears its slot: its work no longer counts
    assert await _until(lambda: me.remote() == {})
    await me.close()


async def test_a_killed_sibling_stops_counting_once_its_heartbeat_is_stale(segment: SharedMemory) -> None:
    stop = multiprocessing.get_context("spawn").Event()
    me = SharedMemoryLoadShare(segment.name, 0, 2, slot_bytes=SLOT_BYTES, stale_after_s=0.5)
    await me.start(dict)
    proc = _spawn(segment.name, {"prefill-0": ([(100, 0, 1.0e9)], [])}, stop)
    assert await _until(lambda: "prefill-0" in me.remote())
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)  # no clean close: the slot still holds its table
    proc.join(30)
    assert segment.buf is not None and slot_written(segment.buf, 1, SLOT_BYTES)
    assert await _until(lambda: me.remote() == {})
    await me.close()


async def test_a_table_too_big_for_the_slot_keeps_the_last_one_and_is_counted(segment: SharedMemory) -> None:
    rows: list[tuple[int, int, float]] = [(1, 0, 1.0e9)]
    share = SharedMemoryLoadShare(segment.name, 0, 2, slot_bytes=SLOT_BYTES)
    await share.start(lambda: {"prefill-0": (list(rows), [])})
    reader = SharedMemoryLoadShare(segment.name, 1, 2, slot_bytes=SLOT_BYTES)
    await reader.start(dict)
    assert len(reader.remote()["prefill-0"][0]) == 1
    rows.extend([(1, 0, 1.0e9)] * 2000)  # ~ 20 KB of msgpack, slots are 4 KB
    share.publish()
    assert share.oversized == 1
    assert len(reader.remote()["prefill-0"][0]) == 1
    await share.close()
    await reader.close()


async def _until(condition: Callable[[], bool]) -> bool:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: wait_for(condition, timeout=30))


async def test_a_change_is_published_before_the_next_beat(segment: SharedMemory) -> None:
    """A dispatch's changed() publishes once the loop's current callbacks ran: with a beat that
    never comes in the test, the sibling sees the new work anyway, and one publish serves all the
    changes of one iteration."""
    table: LoadTable = {}
    mine = SharedMemoryLoadShare(segment.name, 0, 2, slot_bytes=SLOT_BYTES, interval_s=3600)
    sibling = SharedMemoryLoadShare(segment.name, 1, 2, slot_bytes=SLOT_BYTES, interval_s=3600)
    await mine.start(lambda: table)
    await sibling.start(dict)
    publishes = 0
    real = mine.publish

    def counted() -> None:
        nonlocal publishes
        publishes += 1
        real()

    mine.publish = counted  # type: ignore[method-assign]
    try:
        assert sibling.remote() == {}
        table["prefill-0"] = ([(2048, 0, 1.0e9)], [])
        mine.changed()
        table["prefill-0"][0].append((1024, 0, 1.0e9 + 1))
        mine.changed()  # the same iteration: no second publish
        assert sibling.remote() == {}  # not yet: after this iteration's callbacks
        await asyncio.sleep(0)
        queue, _ = sibling.remote()["prefill-0"]
        assert [p.new_tokens for p in queue] == [2048, 1024] and publishes == 1
    finally:
        await mine.close()
        await sibling.close()


async def _blind_window(segment: SharedMemory, *, turns: bool) -> int:
    """This worker decides and dispatches right after its refresh; its sibling refreshes meanwhile:
    the prefills of this worker the sibling then sees (adapters/decision_turn.py FdTurn)."""
    table: LoadTable = {}
    mine = SharedMemoryLoadShare(segment.name, 0, 2, slot_bytes=SLOT_BYTES, interval_s=3600, turns=turns)
    sibling = SharedMemoryLoadShare(segment.name, 1, 2, slot_bytes=SLOT_BYTES, interval_s=3600, turns=turns)
    await mine.start(lambda: table)
    await sibling.start(dict)
    try:
        await mine.refresh(0.0)  # this worker's decision begins (with turns: it holds the lock)
        deciding = asyncio.ensure_future(sibling.refresh(0.0))  # the sibling's begins meanwhile
        table["prefill-0"] = ([(2048, 0, 1.0e9)], [])  # dispatched, before this worker's next await
        await deciding
        return len(sibling.remote().get("prefill-0", ((), ()))[0])
    finally:
        await mine.close()
        await sibling.close()


async def test_with_turns_a_sibling_deciding_meanwhile_sees_the_dispatch(segment: SharedMemory) -> None:
    assert await _blind_window(segment, turns=True) == 1


async def test_without_turns_the_sibling_is_blind_to_it(segment: SharedMemory) -> None:
    """The case turns exist for (and the proof the test above can fail)."""
    assert await _blind_window(segment, turns=False) == 0


async def test_a_turn_held_elsewhere_delays_a_decision_by_max_wait_only(segment: SharedMemory) -> None:
    import fcntl

    share = SharedMemoryLoadShare(segment.name, 0, 2, slot_bytes=SLOT_BYTES, interval_s=3600, turns=True)
    await share.start(dict)
    other = os.open(f"/dev/shm/{segment.name.lstrip('/')}", os.O_RDWR)  # another process's description
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        await asyncio.wait_for(share.refresh(0.0), timeout=30)
        assert share.turn is not None and share.turn.counts["timeouts"] == 1 and not share.turn.holding
        fcntl.flock(other, fcntl.LOCK_UN)
        await share.refresh(0.0)
        assert share.turn.holding and share.turn.counts["taken"] == 1
        await asyncio.sleep(0)  # the decision's step is over: given back
        assert not share.turn.holding
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free for anyone else (raises if not)
    finally:
        os.close(other)
        await share.close()
