"""The freezer collects and then moves survivors out of the collector's later passes."""

from __future__ import annotations

import asyncio
import gc
import weakref

from conductor.ops.gc_freeze import GcFreezer


async def test_it_collects_cycles_then_freezes_the_survivors() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    survivor = [object() for _ in range(1000)]
    gc.disable()  # so only the freezer's own pass can free the cycle
    try:
        garbage = Node()
        ref = weakref.ref(garbage)
        del garbage
        freezer = GcFreezer(0.01)
        freezer.start()
        for _ in range(3000):  # up to ~30 s: a bound for a hang, not a speed check
            if freezer.rounds:
                break
            await asyncio.sleep(0.01)
        await freezer.close()
        assert freezer.rounds >= 1
        assert gc.get_freeze_count() >= len(survivor)
        # the cycle was collected before the freeze, not frozen with the survivors
        assert ref() is None
    finally:
        gc.unfreeze()
        gc.enable()


async def test_off_when_no_interval() -> None:
    freezer = GcFreezer(None)
    freezer.start()
    await asyncio.sleep(0)
    assert freezer.rounds == 0
    await freezer.close()


async def test_start_freezes_at_once_and_raises_the_young_threshold_until_close() -> None:
    from conductor.ops.gc_freeze import YOUNG_THRESHOLD

    before = gc.get_threshold()
    gc.set_threshold(700, before[1], before[2])
    try:
        freezer = GcFreezer(3600.0)  # no periodic round within the test: only the one at start
        freezer.start()
        assert freezer.rounds == 1 and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        await freezer.close()
        assert gc.get_threshold() == (700, before[1], before[2])  # the process's own again
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
