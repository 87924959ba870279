"""Polling for a condition that another thread or process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """True as soon as `cond()` is; its last value once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()
