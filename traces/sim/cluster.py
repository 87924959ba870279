"""Mutable state of the simulated instances: prefix caches, prefill queues, decode batches.

These are the simulator's private bookkeeping (not values handed to policies); the engine turns
them into frozen `InstanceView`s for each decision.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill, Slo
from traces.formats import TraceRequest
from traces.sim.truth import DecodeTruth


class BlockLRU:
    """Which prompt blocks a cache holds; least recently used blocks are evicted past capacity."""

    __slots__ = ("_blocks", "capacity_blocks")

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hash_ids: tuple[int, ...]) -> int:
        """Number of leading blocks present (a prefix match; it stops at the first miss)."""
        blocks = self._blocks
        n = 0
        for h in hash_ids:
            if h not in blocks:
                break
            n += 1
        return n

    def touch(self, hash_ids: tuple[int, ...]) -> None:
        """Mark blocks as just used, inserting the missing ones, then evict down to capacity."""
        if self.capacity_blocks <= 0:
            return
        blocks = self._blocks
        move = blocks.move_to_end
        for h in hash_ids:
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
        excess = len(blocks) - self.capacity_blocks
        if excess > 0:  # a full cache evicts about as many blocks as a prompt brings in
            pop = blocks.popitem
            for _ in range(excess):
                pop(False)


class Cached(Protocol):
    """An instance with a prefix cache: a prefill, or a mixed worker (a DecodeInstance with one)."""

    @property
    def id(self) -> str: ...

    @property
    def cache(self) -> BlockLRU: ...


def index_caches(
    prefills: Sequence[Cached], delay_s: float | None, capacity_tokens: int, block_tokens: int
) -> list[tuple[Cached, BlockLRU]]:
    """(instance, the cache the policy's KV index reports for it) (SimConfig.index_delay_s): its own
    cache when exact; a copy the engine feeds the same blocks `delay_s` late; none with no index."""
    if delay_s is None:
        return []
    if not delay_s:
        return [(p, p.cache) for p in prefills]
    return [(p, BlockLRU(capacity_tokens, block_tokens)) for p in prefills]


class Job:
    """One request's journey through the cluster; times are simulated seconds."""

    __slots__ = (
        "arrival",
        "batch_at_join",
        "cls",
        "decode",
        "decode_view",
        "dispatch",
        "est_cached",
        "est_new",
        "finish",
        "finish_step",
        "first_token",
        "generated",
        "join",
        "kv_need",
        "local",
        "local_tokens",
        "output_tokens",
        "pending_view",
        "pred_tbt",
        "pred_ttft",
        "predicted_cached",
        "preemptions",
        "prefill",
        "prefill_done",
        "prefill_start",
        "pull_prefix",
        "pull_src",
        "pulled_remote",
        "pulled_store",
        "queued_view",
        "ready_at",
        "refused",
        "req",
        "resident_at_join",
        "reused",
        "seq",
        "slo",
        "start_step",
        "tenant",
        "view_gen",
    )

    def __init__(self, seq: int, req: TraceRequest, arrival: float) -> None:
        self.seq = seq
        self.req = req
        self.output_tokens = max(1, req.output_length)  # a served request yields at least one token
        self.kv_need = req.input_length + self.output_tokens  # KV it holds at its last token
        self.pending_view: ActiveDecode | None = None  # how a decode view lists it before it decodes
        self.decode_view: ActiveDecode | None = None  # and while it decodes, as of `view_gen` tokens generated
        self.view_gen = -1
        self.queued_view: QueuedPrefill | None = None  # how a prefill view lists it behind the head
        self.arrival = arrival
        self.prefill = -1  # stays -1 for a local prefill (`local`)
        self.decode = -1
        self.local = 0  # prefilled on its decode instance: 1 until it joins there, then 2
        self.dispatch = arrival
        self.ready_at = arrival  # when any pulled prefix has arrived
        self.pull_src = ""
        self.pull_prefix = 0  # leading tokens it holds once a planned pull is done (local + pulled)
        self.est_new = req.input_length
        self.est_cached = 0
        self.predicted_cached = 0
        self.pred_ttft: float | None = None
        self.pred_tbt: float | None = None
        self.prefill_start = 0.0
        self.prefill_done = 0.0
        self.reused = 0
        self.local_tokens = 0
        self.pulled_remote = 0
        self.pulled_store = 0
        self.join = 0.0
        self.first_token = 0.0
        self.finish = 0.0
        self.start_step = 0.0
        self.finish_step = 0.0  # the decode step its last token comes at (its heap entry's key)
        self.generated = 0.0  # tokens decoded before its last preemption (decode_kv "preempt")
        self.preemptions = 0
        self.batch_at_join = 0
        self.resident_at_join = 0
        # with SimConfig.classes (traces/sim/classes.py): its class, its tenant as the gateway knows
        # it, and its class's SLO; None: no classes (judged by SimConfig.slo)
        self.cls: str | None = None
        self.tenant: str | None = None
        self.slo: Slo | None = None
        self.refused = ""  # why it was refused (a rejection reason), "" while it is not


class PrefillInstance:
    """FCFS prefill queue with a local prefix cache; one prefill runs at a time."""

    __slots__ = (
        "busy_s",
        "cache",
        "id",
        "link_free",
        "out_free",
        "queue",
        "running",
        "running_until",
        "version",
        "view",
        "view_at",
        "view_version",
    )

    def __init__(self, instance_id: str, cache_tokens: int, block_tokens: int) -> None:
        self.id = instance_id
        self.cache = BlockLRU(cache_tokens, block_tokens)
        self.queue: deque[Job] = deque()  # dispatched, not finished; the head runs when `running`
        self.running = False
        self.running_until = 0.0  # when the running prefill ends (valid while `running`)
        self.busy_s = 0.0
        self.link_free = 0.0  # inbound KV link (pulled prefixes) is busy until then
        self.out_free = 0.0  # outbound KV link (P -> D handoffs, pulls from here) is busy until then
        self.version = 0  # bumps whenever the queue changes
        self.view: InstanceView | None = None  # the last view built for policies, reused while fresh
        self.view_at = -1.0
        self.view_version = -1

    def staged_at(self, staging: str | None, now: float, prefix: int, prefill_s: Callable[[int, int], float]) -> float:
        """When a staging request for a `prefix`-token pull has pinned it here (SimConfig.staging):
        after the prefill running here ("priority") or the whole queue ("fcfs"), plus its own one
        token. Its compute is not added to the queue (one token: a small share of a step)."""
        if staging is None:
            return now
        at = self.running_until if self.running else now
        if staging == "fcfs":
            at += sum(prefill_s(j.est_new, j.est_cached) for j in list(self.queue)[1 if self.running else 0 :])
        return at + prefill_s(1, prefix)


KV_WATERMARK = 0.01  # vLLM's default: a sequence is admitted only while this share of KV blocks stays free


class DecodeInstance:
    """Continuous batching, modelled as a fluid: between joins and finishes every running sequence
    gains one token per step and the step time is constant, so only joins, finishes and (with
    `preempt`) the moments the KV cache fills are events, not every token. Sequences waiting for
    KV space queue FIFO.

    KV space, two ways (SimConfig.decode_kv):
    * reserve (`preempt` False): a sequence joins only when its prompt and all its output fit in
      what the running ones reserved; nothing is ever preempted. Needs the output length up front,
      which a real engine does not have.
    * preempt (vLLM): a sequence joins when its context fits in the free KV now; when the running
      sequences' growth fills the cache, the one that joined last is preempted -- its KV dropped,
      back to the head of the queue -- and when it rejoins its whole context is recomputed on this
      instance, a prefill every running sequence waits for (vLLM's recompute preemption).
    """

    __slots__ = (
        "active",
        "assigned",
        "busy_s",
        "cache",
        "heap",
        "id",
        "link_free",
        "preempt",
        "preemptions",
        "reserved",
        "steps",
        "sum_prompt",
        "sum_start",
        "t_last",
        "tbt",
        "tick",
        "truth",
        "version",
        "view",
        "view_at",
        "view_version",
        "waiting",
    )

    def __init__(self, instance_id: str, truth: DecodeTruth, preempt: bool = False, cache_tokens: int = 0) -> None:
        self.id = instance_id
        # a mixed worker's prefix cache (SimConfig.mixed); empty and never filled for a decode instance
        self.cache = BlockLRU(cache_tokens, 512)
        self.truth = truth
        self.preempt = preempt
        self.preemptions = 0
        self.steps = 0.0  # decode steps done since the start (fractional between events)
        self.t_last = 0.0  # steps are counted up to here; later than now while a recompute stalls the batch
        self.tbt = truth.base_s
        self.active: dict[int, Job] = {}  # in join order: the last is the one preempted first
        self.heap: list[tuple[float, int]] = []  # (step at which the job finishes, job seq); stale entries skipped
        self.sum_prompt = 0
        self.sum_start = 0.0
        self.reserved = 0  # KV tokens reserved by running sequences (prompt + all output; reserve mode)
        self.waiting: deque[Job] = deque()
        self.version = 0  # bumps whenever its view changes (routing, join, finish)
        # generation of the one pending tick event: bumped each time a tick is scheduled, so a tick
        # scheduled before is void. Routing a request here does not bump it (the batch is unchanged)
        self.tick = 0
        self.busy_s = 0.0
        self.link_free = 0.0
        self.assigned: dict[int, Job] = {}  # routed here and not finished (the gateway's view)
        self.view: tuple[object, ...] = ()
        self.view_at = -1.0
        self.view_version = -1

    def advance(self, now: float) -> None:
        if now > self.t_last:
            if self.active:
                self.busy_s += now - self.t_last
                self.steps += (now - self.t_last) / self.tbt
            self.t_last = now

    def _resident(self) -> float:
        return self.sum_prompt + len(self.active) * self.steps - self.sum_start

    def resident_kv(self) -> int:
        return int(self._resident())

    def usage(self) -> float:
        """Share of the KV capacity in use (reserve mode: reserved)."""
        used = self._resident() if self.preempt else self.reserved
        return min(1.0, used / max(1, self.truth.kv_capacity_tokens))

    def fits(self, job: Job) -> bool:
        if not self.active:
            return True  # an empty instance takes anything: a lone over-long request must not deadlock
        if len(self.active) >= self.truth.max_batch:
            return False
        if self.preempt:  # its context and the next step's tokens, below vLLM's 1% watermark: a join
            # never fills the cache at once, so every join is followed by some progress
            cap = self.truth.kv_capacity_tokens
            need = job.req.input_length + job.generated + len(self.active) + 1
            return self._resident() + need <= cap - cap * KV_WATERMARK
        return self.reserved + job.kv_need <= self.truth.kv_capacity_tokens

    def join(self, job: Job, now: float) -> None:
        """Add `job` to the batch (after a preemption: with the tokens it had generated)."""
        self.active[job.seq] = job
        job.start_step = self.steps - job.generated
        job.finish_step = job.start_step + job.output_tokens
        if not job.generated:
            job.join = now
        heapq.heappush(self.heap, (job.finish_step, job.seq))
        self.sum_prompt += job.req.input_length
        self.sum_start += job.start_step
        self.reserved += job.kv_need
        self.version += 1

    def stall(self, now: float, seconds: float) -> None:
        """The batch makes no progress for `seconds` from now (a rejoin's recompute)."""
        self.advance(now)  # t_last is now, or later while an earlier recompute still stalls the batch
        self.busy_s += seconds
        self.t_last += seconds

    def _leave(self, job: Job) -> None:
        self.sum_prompt -= job.req.input_length
        self.sum_start -= job.start_step
        self.reserved -= job.kv_need

    def pop_finished(self) -> list[Job]:
        done = []
        while self.heap and self.heap[0][0] <= self.steps + 1e-6:
            step, seq = heapq.heappop(self.heap)
            job = self.active.get(seq)
            if job is None or job.finish_step != step:
                continue  # preempted: its entry went stale (a rejoin pushed a new one)
            del self.active[seq]
            self._leave(job)
            done.append(job)
        if done:
            self.version += 1
        if not self.active:  # keep float drift from accumulating across busy periods
            self.sum_start = 0.0
        return done

    def preempt_overflow(self) -> list[Job]:
        """With `preempt`: while the running sequences' next step does not fit in the KV cache,
        preempt the one that joined last (never the last one left); they go back to `waiting`'s head."""
        out: list[Job] = []
        cap = self.truth.kv_capacity_tokens
        while self.preempt and len(self.active) > 1 and self._resident() + len(self.active) > cap - 1e-3:
            _, job = self.active.popitem()
            job.generated = self.steps - job.start_step
            job.preemptions += 1
            self._leave(job)
            out.append(job)
        if out:
            self.preemptions += len(out)
            self.version += 1
            self.waiting.extendleft(out)  # the one that joined first ends up at the head, as in vLLM's FCFS queue
        return out

    def retime(self, noise: float) -> float | None:
        """New step time for the current batch; returns when the next sequence finishes or (with
        `preempt`) when the KV cache fills, whichever comes first."""
        self.tbt = self.truth.tbt_s(len(self.active), self.resident_kv()) * noise
        nxt = None
        if self.heap:
            nxt = self.t_last + max(0.0, self.heap[0][0] - self.steps) * self.tbt
        n = len(self.active)
        if self.preempt and n > 1:
            room = self.truth.kv_capacity_tokens - self._resident() - n  # until the next step would not fit
            full = self.t_last + max(0.0, room / n) * self.tbt
            nxt = full if nxt is None else min(nxt, full)
        return nxt
