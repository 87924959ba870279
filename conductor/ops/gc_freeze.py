"""Keep long-lived state out of the cyclic garbage collector's full passes.

A gateway or indexer holding a large KV index has hundreds of thousands of long-lived containers.
CPython's full (generation 2) collection walks every tracked object, so once the index is big each
full pass stalls the event loop for tens of milliseconds, and the look-ups that wait behind it make
the p99 (benchmarks/bench_scale.py, a `conductor indexer` with 1,024 instances: look-up p99 44 ms
with the default collector, 6 ms with the index frozen; p50 unchanged). Nothing in the index is
cyclic garbage: its entries are freed by reference counting when evicted, frozen or not.

`GcFreezer` runs beside the server: at start and then every `interval_s` it collects once (so
garbage cycles made so far are freed, not frozen) and moves every surviving object to the permanent
generation (`gc.freeze()`), which later passes skip. One full pass per interval instead of one every
few thousand allocations. `interval_s` None or 0 turns it off.

It also raises the youngest generation's threshold from CPython's 700 to `YOUNG_THRESHOLD`. The
request path makes no reference cycles (tests/conductor/server/test_reference_cycles.py), so the
young collections find nothing to free; yet at 700 one ran every ~16 requests, and the collector
took 0.8-0.9 s of an 8 s run at concurrency 64, about 32 us of CPU per request (measured with
gc.callbacks; docs/performance.md). Frozen at start and at 7,000 it took 0.05-0.07 s, and CPU per
request fell from 231-254 us to 179-186 us (mixed, non-streamed, round robin).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from adapters.tasks import cancel_and_wait

log = logging.getLogger(__name__)


YOUNG_THRESHOLD = 7000  # allocations (net) between young collections; CPython's default is 700


class GcFreezer:
    """A background task: collect, then freeze, at start and every `interval_s`."""

    def __init__(self, interval_s: float | None) -> None:
        self.interval_s = interval_s
        self.rounds = 0
        self.last_pause_s = 0.0  # how long the last collect + freeze held the loop
        self._task: asyncio.Task[None] | None = None
        self._thresholds: tuple[int, int, int] | None = None  # the collector's own, while raised

    def start(self) -> None:
        if self.interval_s and self._task is None:
            self.freeze_now()  # the modules, settings and tables built at start-up: never walked again
            current = gc.get_threshold()
            if current[0] < YOUNG_THRESHOLD:
                self._thresholds = current
                gc.set_threshold(YOUNG_THRESHOLD, current[1], current[2])
            self._task = asyncio.create_task(self._run(), name="gc-freeze")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._thresholds is not None:  # the process may go on (tests, an embedding application)
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def freeze_now(self) -> None:
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.rounds += 1
        self.last_pause_s = time.perf_counter() - started
        log.debug("gc: collected and froze %d objects in %.1f ms", gc.get_freeze_count(), self.last_pause_s * 1e3)

    async def _run(self) -> None:
        assert self.interval_s
        while True:
            await asyncio.sleep(self.interval_s)
            self.freeze_now()
