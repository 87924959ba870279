"""Stopping a background task: the one way the gateway's and the adapters' loops are shut down.

Every long-running loop (KV event subscribers, DNS discovery, the deadline sweep, the GC freezer,
the emulator's engine and replay server) is an asyncio task that runs until cancelled. Stopping one
means cancelling it and waiting until it has really ended, so nothing it owns (a socket, a timer)
is used after its owner closed it; its own cancellation is the expected outcome, not an error,
while any other exception it ended with still propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None, within_s: float | None = None) -> bool:
    """Cancel `task` (None: nothing to do) and wait until it has ended, or at most `within_s`
    seconds (a task that ignores its cancellation holds no shutdown forever): whether it ended.
    The task keeps running past that bound; it is not waited for again."""
    if task is None:
        return True
    task.cancel()
    if within_s is not None:
        done, _ = await asyncio.wait((task,), timeout=within_s)
        if not done:
            return False
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return True
