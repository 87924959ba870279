"""The gateway's waiting room in the simulator (conductor/routing/waiting_room.py, `hold` settings).

A job refused for its TBT only (policies.admission.holdable) waits instead of being refused, as the
gateway holds such a request: it is decided again when a stream ends (the WAKE_PER_END jobs that
have waited longest since they were last decided, as the gateway wakes them), with its TTFT SLO
less the time it has waited, and once more at its deadline (its TTFT SLO or `hold_max_wait_s`
after it was first held), when a refusal is sent. At most `hold_max` wait at once. The job's own
SLO, which the results judge it by, is untouched; a held job's TTFT counts its wait, and what the
policy learns of it counts from its admission (Job.dispatch), as the gateway's Observation does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from conductor.core.types import RequestView, Slo
from policies.admission import WAKE_PER_END, slo_after_wait
from traces.sim.cluster import Job


class SimWaitingRoom:
    """The held jobs, the longest waiting since they were last decided first."""

    __slots__ = ("_queue", "_since", "max_held", "max_wait_s")

    def __init__(self, max_held: int, max_wait_s: float) -> None:
        self.max_held = max_held
        self.max_wait_s = max_wait_s
        self._queue: deque[Job] = deque()
        self._since: dict[int, float] = {}  # job.seq -> when it was first held

    def __len__(self) -> int:
        return len(self._since)

    def hold(self, job: Job, slo: Slo, now: float) -> float | None:
        """Hold a job refused for its TBT only (policies.admission.holdable) where there is room:
        its deadline; else None (the refusal stands)."""
        if slo.ttft_s is None or len(self._since) >= self.max_held:
            return None
        self._since[job.seq] = now
        self._queue.append(job)
        return now + min(slo.ttft_s, self.max_wait_s)

    def woken(self) -> list[Job]:
        """The jobs a stream's end decides again (each out of the queue until `back`)."""
        out: list[Job] = []
        queue = self._queue
        while queue and len(out) < WAKE_PER_END:
            job = queue.popleft()
            if job.seq in self._since:  # not decided at its deadline meanwhile
                out.append(job)
        return out

    def held(self, job: Job) -> bool:
        return job.seq in self._since

    def back(self, job: Job) -> None:
        """Decided again and still held: behind the others."""
        self._queue.append(job)

    def release(self, job: Job) -> None:
        """Admitted or refused: out of the room (a stale queue entry is skipped by `woken`)."""
        del self._since[job.seq]

    def view(self, view: RequestView, job: Job, now: float) -> RequestView:
        """The job's view with its TTFT SLO less the time it has waited."""
        return replace(view, slo=slo_after_wait(view.slo, now - self._since[job.seq]))
