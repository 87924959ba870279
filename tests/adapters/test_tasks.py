"""adapters/tasks.cancel_and_wait: the one way a background task is stopped, bounded on request."""

from __future__ import annotations

import asyncio

import pytest

from adapters.tasks import cancel_and_wait


async def test_a_cancelled_task_has_ended_when_it_returns() -> None:
    started = asyncio.Event()

    async def loop() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(loop())
    await started.wait()
    assert await cancel_and_wait(task) is True
    assert task.cancelled()
    assert await cancel_and_wait(None) is True


async def test_a_task_that_ignores_its_cancellation_is_given_up_after_the_bound() -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def stubborn() -> None:
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores it: only `release` ends it

    task = asyncio.create_task(stubborn())
    await started.wait()
    assert await cancel_and_wait(task, within_s=0.01) is False
    assert not task.done()
    release.set()
    await task  # it ends once released, on its own


async def test_an_error_the_task_ended_with_still_propagates() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.wait((task,))  # it has ended on its error before it is stopped
    with pytest.raises(RuntimeError, match="boom"):
        await cancel_and_wait(task, within_s=1.0)
