"""The deadline sweep: cancels exactly the requests past their deadline, on a clock the test controls."""

from __future__ import annotations

import asyncio

import pytest

from conductor.routing.deadlines import Deadlines


async def _sleeper() -> None:
    await asyncio.sleep(3600)


async def test_the_sweep_cancels_only_what_is_past_its_deadline() -> None:
    deadlines = Deadlines(10.0)
    tasks = [asyncio.create_task(_sleeper()) for _ in range(3)]
    entries = [deadlines.enter(t, now) for t, now in zip(tasks, (0.0, 1.0, 2.0), strict=True)]
    assert deadlines.sweep(10.5) == 1  # only the first: entered at 0, due at 10
    await asyncio.sleep(0)
    assert entries[0].expired and tasks[0].cancelled()
    assert not entries[1].expired and not tasks[1].done()
    deadlines.leave(entries[1])  # finished in time: never cancelled
    assert deadlines.sweep(100.0) == 1 and entries[2].expired and not entries[1].expired
    assert len(deadlines) == 0 and deadlines.expired == 2
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_sweeper_runs_on_its_own_and_stops() -> None:
    deadlines = Deadlines(0.05)
    assert deadlines.tick_s == 0.01  # a twentieth of the timeout, at least 10 ms
    deadlines.start()
    task = asyncio.create_task(_sleeper())
    entry = deadlines.enter(task, asyncio.get_running_loop().time())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert entry.expired
    await deadlines.close()
    assert Deadlines(600).tick_s == 0.5
