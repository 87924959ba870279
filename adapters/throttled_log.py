"""A warning at most once per interval, with how many were held back meanwhile.

For what a peer can make happen at will (a flood of bad KV event messages, of malformed requests):
one line per interval says it is going on, and a flood of input never becomes a flood of log lines.
"""

from __future__ import annotations

import logging
import time


class ThrottledLog:
    """Warnings to `logger`, at most one per `interval_s`; the next one says how many were dropped."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._next_at = 0.0
        self._held_back = 0

    def warn(self, message: str, *args: object) -> bool:
        """Log it unless one was logged within the interval; whether it was."""
        now = time.monotonic()
        if now < self._next_at:
            self._held_back += 1
            return False
        if self._held_back:
            message += " (and %d more since the last report)"
            args = (*args, self._held_back)
        self.logger.warning(message, *args)
        self._next_at, self._held_back = now + self.interval_s, 0
        return True
