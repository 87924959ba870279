"""Polling for a condition that another thread or process makes true: the bound is generous, met
only by a hang, never a measure of speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, interval: float = 0.02) -> bool:
    """True as soon as `cond()` is; its last value once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


async def until(cond: Callable[[], Awaitable[bool]], within_s: float = 30.0, interval: float = 0.02) -> bool:
    """wait_for for an async condition, polled on the running loop (which keeps serving meanwhile)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(interval)
    return await cond()
