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


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to do) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
