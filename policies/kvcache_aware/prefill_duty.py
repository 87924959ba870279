"""Each mixed worker's recent prefill duty, so a less urgent class leaves the urgent streams their TBT.

On a mixed worker every prefill step carries the decodes, so a stream's time between tokens is its
decode step stretched by the share of time the worker spends prefilling: `tbt / (1 - duty)` (the
emulator's and vLLM's step, the same stretch policies/local_prefill.py applies to a decode that
prefills locally). A stream's TBT prediction sees the batch, not the prefills that will arrive while
it decodes; under overload those arrive back to back and every urgent stream missed its TBT
(benchmarks/bench_tenants.py, 3x: 39% met among admitted with the guarded SLO alone). So a request
of a less urgent class (policies/classes.py) is judged on a worker by its TBT bound stretched by the
duty the worker would have with its prefill added: the prefill seconds of the requests admitted there
within the last `WINDOW_S`, this one's included, over the window. The urgent class is judged as
before: it is the class the room is kept for.

A young policy (a fresh fleet, the gateway just started) has seen less than the window: its duty is
over the time since its first decision, at least `MIN_SPAN_S`. Over the whole window, as if the fleet
had idled before, the first seconds of an overload read as a low duty; the batch admitted then
stalled the urgent streams already decoding: every urgent miss of the simulated 3x (4 seeds, 98.0%
met among admitted) came in its first 2.4 s. Over the seconds seen alone, one prefill at start-up
read as a full duty and refused every batch request behind it. With `MIN_SPAN_S` (simulated 3x, 8
seeds, benchmarks/bench_sim_tenants.py): 100% met, the batch admitted 7% (9% before), tenant A's loss
to the flood 1.1 points (docs/benchmarks.md).

Bounded: at most `MAX_ENTRIES` prefills remembered (the oldest go first), pruned by age on record.
"""

from __future__ import annotations

from collections import deque

from conductor.core.types import Decision

WINDOW_S = 10.0  # about an urgent stream's life at the bench's TBT SLO: the prefills it sits through
MIN_SPAN_S = 5.0  # a young policy's duty is over at least this much of the window (module docstring)
MAX_DUTY = 0.95  # a duty above this stretches a TBT past any SLO; capped so the stretch stays finite
MAX_ENTRIES = 8192


class PrefillDuty:
    """Prefill seconds admitted per worker, over the last `WINDOW_S`."""

    __slots__ = ("_busy", "_entries", "_since")

    def __init__(self) -> None:
        self._entries: deque[tuple[float, str, float]] = deque()  # (when, worker, prefill seconds), oldest first
        self._busy: dict[str, float] = {}  # worker -> the sum of its entries' seconds
        self._since: float | None = None  # the first decision recorded: the window is shorter before WINDOW_S

    def stretch(self, worker: str, prefill_s: float, now: float) -> float:
        """The factor a stream's TBT on `worker` is stretched by with a prefill of `prefill_s` added."""
        busy = self._busy.get(worker, 0.0)
        if self._entries and self._entries[0][0] < now - WINDOW_S:  # not pruned since: count only the window
            busy = sum(s for at, w, s in self._entries if w == worker and at >= now - WINDOW_S)
        span = WINDOW_S if self._since is None else min(WINDOW_S, max(MIN_SPAN_S, now - self._since))
        duty = min(MAX_DUTY, (busy + prefill_s) / span)
        return 1.0 / (1.0 - duty)

    def record(self, decision: Decision, now: float) -> None:
        """An admitted decision's prefill seconds on its prefill worker (the chosen candidate's)."""
        if self._since is None:
            self._since = now
        worker = decision.prefill
        if worker is None or decision.rejection is not None:
            return
        seconds = next((c.detail.get("prefill_s", 0.0) for c in decision.candidates if c.instance_id == worker), 0.0)
        entries, busy = self._entries, self._busy
        while entries and (entries[0][0] < now - WINDOW_S or len(entries) >= MAX_ENTRIES):
            _, old, s = entries.popleft()
            left = busy[old] - s
            if left <= 1e-12:
                del busy[old]
            else:
                busy[old] = left
        if seconds > 0:
            entries.append((now, worker, seconds))
            busy[worker] = busy.get(worker, 0.0) + seconds
