"""The discrete-event loop: arrivals, policy decisions, prefill, KV transfer, decode, observation.

The policy under test sees what a live gateway would see and nothing more: a RequestView whose
`cached` comes from the cache index (exact by default: the simulator's index knows every block each
prefill instance and the store hold, as a gateway fed by KV events would; `index_delay_s` makes it
learn them late, or not at all) and a ClusterSnapshot of
prefill queues and decode streams it dispatched. Outcomes go back through `policy.observe`, so the
policy's own predictors fit online and their error shows in the result.

Modelling choices, each with its reason: docs/simulator.md, "What is modelled" (prefix reuse and
pulls, one transfer per link and direction, the P -> D handoff, decode KV space, mixed workers,
priority classes and tenants, the gateway's waiting room).
"""

from __future__ import annotations

import gc
import heapq
import random
import time
from collections import Counter
from collections.abc import Sequence

from conductor.core.capabilities import ClassAware
from conductor.core.types import CachedPrefix, Decision, Policy, PrefillLeg, PrefillLegObserver, RequestView
from policies.admission import holdable
from traces.formats import TraceRequest
from traces.sim.classes import admit
from traces.sim.cluster import BlockLRU, DecodeInstance, Job, PrefillInstance, index_caches
from traces.sim.config import SimConfig
from traces.sim.hold import SimWaitingRoom
from traces.sim.instance_views import cluster_view, request_view_of
from traces.sim.pulls import plan_pull
from traces.sim.results import RunResult
from traces.sim.summary import run_result
from traces.sim.views import job_observation, mixed_leg, refused_observation

_PREFILL_DONE, _PULL_READY, _DECODE_ARRIVE, _DECODE_TICK, _INDEXED, _FIRST_TOKEN, _HOLD_WAKE, _HOLD_DUE = range(8)
MAX_QUEUE = 100_000  # requests routed to one decode instance; past it they are rejected ("queue_full")


class Simulator:
    """One run of one policy over one trace on one simulated cluster."""

    def __init__(self, policy: Policy, config: SimConfig) -> None:
        self.policy = policy
        # told each prefill leg as it ends, as the gateway tells it after a NIXL prefill answers
        # and at a mixed worker's first token (a stream's: the simulator's requests all stream)
        self._leg_observer = policy if isinstance(policy, PrefillLegObserver) and config.observe else None
        self._mixed_legs = self._leg_observer is not None and config.mixed
        self.cfg = config
        self.truth = config.truth
        self.rng = random.Random(config.seed)
        self.prefills = [PrefillInstance(i, config.prefill_cache_tokens, 512) for i in config.prefill_ids()]
        self.gate = config.classes.admission(lambda: self.now) if config.classes is not None else None
        self.room = SimWaitingRoom(config.hold_max, config.hold_max_wait_s)  # the gateway's `hold`
        if config.classes is not None and isinstance(policy, ClassAware):  # as the gateway tells it at start-up
            policy.configure_classes(config.classes.rules)
        # staged peer pulls (SimConfig.staging): every prefill is a source the policy must wait on
        self._staged_sources = frozenset(p.id for p in self.prefills) if config.staging else frozenset()
        self._staging_jumps = config.staging == "priority"
        preempt = config.decode_kv == "preempt"
        local_cache = config.prefill_cache_tokens if config.mixed else 0
        self.decodes = [DecodeInstance(i, config.truth.decode, preempt, local_cache) for i in config.decode_ids()]
        self.p_index = {p.id: n for n, p in enumerate(self.prefills)}
        self.d_index = {d.id: n for n, d in enumerate(self.decodes)}
        self.store = BlockLRU(config.store_capacity_tokens, 512)
        # the caches the policy's KV index reports (SimConfig.index_delay_s, cluster.index_caches)
        self._index_delay = config.index_delay_s
        self._cached = self.decodes if config.mixed else self.prefills  # the instances with prefix caches
        self._indexes = index_caches(self._cached, self._index_delay, config.prefill_cache_tokens, 512)
        self.events: list[tuple[float, int, int, int, object]] = []
        self._ev_seq = 0  # events pushed so far: their tie-breaking order in the heap, and a run's size
        self.now = 0.0
        self.rejections: Counter[str] = Counter()
        self.jobs: list[Job] = []  # every job of the run, refused ones included
        self.wasted_prefill = 0  # prefills done for requests then rejected at the decode stage
        self.refused_pulls = 0  # pulls a decision asked for over a mechanism this cluster lacks
        self.done: list[Job] = []
        self._prefixes: dict[int, CachedPrefix] = {}  # tokens -> the one (frozen) CachedPrefix of that size

    @property
    def events_pushed(self) -> int:
        return self._ev_seq

    # -- plumbing ---------------------------------------------------------------------------
    def _push(self, t: float, kind: int, target: int, payload: object = None) -> None:
        self._ev_seq += 1
        heapq.heappush(self.events, (t, self._ev_seq, kind, target, payload))

    def _noise(self) -> float:
        s = self.cfg.noise
        return self.rng.lognormvariate(-0.5 * s * s, s) if s > 0 else 1.0

    # -- the gateway's view -----------------------------------------------------------------
    def _tokens(self, blocks: int, req: TraceRequest) -> int:
        return min(blocks * req.block_tokens, req.input_length)

    def _request_view(self, job: Job) -> RequestView:
        aware = self._index_delay is not None  # else KV awareness is off: no block keys either
        store = self.store if aware and self.store.capacity_blocks else None
        return request_view_of(job, self._indexes, self._prefixes, store, self.cfg, self._staged_sources, self._staging_jumps)

    # -- arrivals and decisions -------------------------------------------------------------
    def _enter(self, job: Job) -> bool:
        """Classes and tenants (SimConfig.classes): False when the gateway's shares refuse the job."""
        classes = self.cfg.classes
        reason = admit(self.gate, classes, job, self.cfg.slo) if self.gate is not None and classes is not None else None
        if reason is not None:
            self.rejections[reason] += 1
            job.refused = reason
        return reason is None

    def _refuse(self, job: Job, reason: str) -> None:
        """A job refused after it entered the gateway's shares (it leaves them: its 429 is sent)."""
        self.rejections[reason] += 1
        job.refused = reason
        if self.gate is not None:
            self.gate.leave(job.tenant)

    def _decide(self, job: Job, may_hold: bool) -> None:
        """Decide the job and act on it: on arrival, or held (traces/sim/hold.py) at a stream's end
        (`may_hold`: a refusal for its TBT only holds it on) or at its deadline."""
        held = self.room.held(job)
        view = self.room.view(self._request_view(job), job, self.now) if held else self._request_view(job)
        snapshot = cluster_view(self.prefills, self.decodes, self.now, self.cfg)
        decision = self.policy.decide(view, snapshot)
        if may_hold and holdable(decision):  # it waits for streams to end, where there is room
            if held:
                self.room.back(job)
                return
            due = self.room.hold(job, view.slo, self.now)
            if due is not None:
                self._push(due, _HOLD_DUE, 0, job)
                return
        elif held:
            self.room.release(job)
        self.policy.on_decided(view, snapshot, decision)
        if decision.rejection is not None:
            self._refuse(job, decision.rejection.reason)
            return
        p_idx = self.p_index.get(decision.prefill or "")
        # a mixed worker is named as the prefill (Decision: decode None); a local prefill names the decode twice
        d_idx = self.d_index.get((decision.prefill if self.cfg.mixed else decision.decode) or "")
        if d_idx is not None and (self.cfg.mixed or decision.prefilled_on_decode):
            self._arrive_local(job, decision, d_idx, view)
            return
        if p_idx is None or d_idx is None:
            self._refuse(job, "invalid_decision")
            return
        p, d = self.prefills[p_idx], self.decodes[d_idx]
        if len(p.queue) >= self.cfg.max_prefill_queue or len(d.assigned) >= MAX_QUEUE:
            self._refuse(job, "queue_full")
            return
        job.prefill, job.decode, job.dispatch = p_idx, d_idx, self.now
        job.pred_ttft, job.pred_tbt = decision.predicted_ttft_s, decision.predicted_tbt_s
        local = view.cached.get(p.id)
        local_tokens = local.tokens if local else 0
        job.predicted_cached = local_tokens
        if plan_pull(job, decision, p, local_tokens, self.prefills, self.p_index, self.store, self.cfg, self.now):
            self.refused_pulls += 1  # over a mechanism this cluster's transfer setup lacks
        job.est_cached = min(max(local_tokens, job.pull_prefix), job.req.input_length - 1)
        job.est_new = job.req.input_length - job.est_cached
        p.queue.append(job)
        p.version += 1
        d.assigned[job.seq] = job
        d.version += 1  # its view changed; its pending tick stays valid (the batch did not change)
        if len(p.queue) == 1:
            self._try_start(p_idx)

    def _arrive_local(self, job: Job, decision: Decision, d_idx: int, view: RequestView) -> None:
        """A prefill on the decode instance itself (policies/local_prefill.py, or a mixed worker):
        it waits there for KV space like any stream, and when it joins, the batch stalls while its
        prefill runs."""
        d = self.decodes[d_idx]
        if len(d.assigned) >= MAX_QUEUE:
            self._refuse(job, "queue_full")
            return
        if self.cfg.mixed:  # what the index said it holds: the prefill queue's entry, as the gateway lists it
            local = view.cached.get(d.id)
            job.predicted_cached = job.est_cached = min(local.tokens if local else 0, job.req.input_length - 1)
            job.est_new = job.req.input_length - job.est_cached
        job.decode, job.dispatch, job.local = d_idx, self.now, 1
        job.pred_ttft, job.pred_tbt = decision.predicted_ttft_s, decision.predicted_tbt_s
        d.assigned[job.seq] = job
        d.version += 1
        d.advance(self.now)
        d.waiting.append(job)
        self._admit_and_retime(d_idx)

    # -- prefill ----------------------------------------------------------------------------
    def _try_start(self, p_idx: int) -> None:
        p = self.prefills[p_idx]
        if p.running or not p.queue:
            return
        job = p.queue[0]
        if job.ready_at > self.now:
            self._push(job.ready_at, _PULL_READY, p_idx)
            return
        req = job.req
        local = self._tokens(p.cache.match(req.hash_ids), req)
        pulled = job.pull_prefix if job.pull_prefix > local else 0
        job.reused = min(max(local, pulled), req.input_length - 1)
        job.local_tokens = min(local, job.reused)
        extra = job.reused - job.local_tokens
        if job.pull_src == "store":
            job.pulled_store = extra
        else:
            job.pulled_remote = extra
        new = req.input_length - job.reused
        dur = self.truth.prefill_s(new, job.reused) * self._noise()
        p.running = True
        p.running_until = self.now + dur
        job.prefill_start = self.now
        p.busy_s += dur
        self._push(self.now + dur, _PREFILL_DONE, p_idx)

    def _prefill_done(self, p_idx: int) -> None:
        p = self.prefills[p_idx]
        job = p.queue.popleft()
        p.version += 1
        p.running = False
        job.prefill_done = self.now
        if self._leg_observer is not None:
            self._leg_observer.observe_prefill_leg(
                PrefillLeg(f"r{job.seq}", p.id, job.req.input_length, job.reused, self.now - job.dispatch)
            )
        p.cache.touch(job.req.hash_ids)
        if self._index_delay:  # the index hears of these blocks later (its KV events)
            self._push(self.now + self._index_delay, _INDEXED, p_idx, job.req.hash_ids)
        self.store.touch(job.req.hash_ids)
        d = self.decodes[job.decode]
        n = job.req.input_length
        if self.cfg.kv_handoff == "layerwise":  # each layer's KV leaves as the prefill computes it: the
            # transfer ran from the prefill's start (behind what the links carried by now), and the
            # last layer's share goes after the prefill ends
            start = max(job.prefill_start, d.link_free, p.out_free)
            arrive = max(self.now + self.truth.transfer_s(-(-n // self.cfg.kv_layers)), start + self.truth.transfer_s(n))
        else:
            arrive = max(self.now, d.link_free, p.out_free) + self.truth.transfer_s(n)
        d.link_free = p.out_free = arrive
        self._push(arrive, _DECODE_ARRIVE, job.decode, job)
        self._try_start(p_idx)

    # -- decode -----------------------------------------------------------------------------
    def _decode_arrive(self, d_idx: int, job: Job) -> None:
        d = self.decodes[d_idx]
        d.advance(self.now)
        slo = self.cfg.slo.tbt_s
        # the system's own protection at the decode stage (arXiv 7.1, the baseline's second
        # decision): joining would push the step time past the TBT SLO -> rejected here, its
        # prefill wasted. Judged on the real batch, not on any policy's prediction.
        if self.cfg.decode_guard and slo is not None and d.active:  # noqa: SIM102 - the comment above is for the inner test
            if self.truth.decode.tbt_s(len(d.active) + len(d.waiting) + 1, d.resident_kv() + job.req.input_length) > slo:
                self._refuse(job, "decode_overload")  # admitted, then refused: its prefill ran
                del d.assigned[job.seq]
                d.version += 1  # the view changed
                self._admit_and_retime(d_idx)
                self.wasted_prefill += 1
                if self.cfg.observe:
                    self.policy.observe(refused_observation(job, self.prefills[job.prefill].id, d.id))
                return
        d.waiting.append(job)
        self._admit_and_retime(d_idx)

    def _admit_and_retime(self, d_idx: int) -> None:
        d = self.decodes[d_idx]
        d.preempt_overflow()
        joined = []
        while d.waiting and d.fits(d.waiting[0]):
            job = d.waiting.popleft()
            if job.preemptions:  # its KV was dropped: the whole context is recomputed here first
                d.join(job, self.now)
                context = job.req.input_length + int(job.generated)
                d.stall(self.now, self.truth.prefill_s(context, 0) * self._noise())
                continue
            d.join(job, self.now)
            if job.local == 1:  # its prefill runs here, behind any stall in progress: the batch waits
                job.local, job.prefill_start = 2, max(self.now, d.t_last)
                reused = self._reuse_local(d_idx, job)
                prefill_s = self.truth.prefill_s(job.req.input_length - reused, reused) * self._noise()
                if self.cfg.mixed:  # the decodes ride in a mixed worker's prefill step (the emulator's, vLLM's):
                    # it lasts T_prefill + (step - base) and yields their next token, as a stall of
                    # T_prefill - base followed by a step does
                    prefill_s = max(0.0, prefill_s - self.truth.decode.base_s)
                d.stall(self.now, prefill_s)
                job.prefill_done = d.t_last
            job.batch_at_join, job.resident_at_join = len(d.active), d.resident_kv() + job.req.input_length
            joined.append(job)
        nxt = d.retime(self._noise())
        start = max(self.now, d.t_last)  # after any recompute this admission started
        for job in joined:
            job.first_token = start + d.tbt
            if self._mixed_legs:  # a first join (a rejoin after preemption is not listed): its leg is told then
                self._push(job.first_token, _FIRST_TOKEN, d_idx, job)
        d.tick += 1  # whatever tick was pending is void: this one replaces it
        if nxt is not None:
            self._push(nxt, _DECODE_TICK, d_idx, d.tick)

    def _reuse_local(self, d_idx: int, job: Job) -> int:
        """The prefix a local prefill reuses from its worker's cache (a mixed worker's; a decode
        instance has none), whose blocks it then holds (the index hears of them as of a prefill's)."""
        if not self.cfg.mixed:
            return 0
        d, req = self.decodes[d_idx], job.req
        job.reused = job.local_tokens = min(self._tokens(d.cache.match(req.hash_ids), req), req.input_length - 1)
        d.cache.touch(req.hash_ids)
        if self._index_delay:
            self._push(self.now + self._index_delay, _INDEXED, d_idx, req.hash_ids)
        return job.reused

    def _decode_tick(self, d_idx: int, tick: int) -> None:
        d = self.decodes[d_idx]
        if tick != d.tick:
            return  # superseded: rescheduled by a later join, finish or arrival
        d.advance(self.now)
        for job in d.pop_finished():
            job.finish = max(self.now, job.first_token)
            del d.assigned[job.seq]
            self._finish(job)
        self._admit_and_retime(d_idx)

    def _finish(self, job: Job) -> None:
        self.done.append(job)
        if len(self.room):  # a stream ended: held jobs are decided again, once this event is over
            self._push(self.now, _HOLD_WAKE, 0)
        if self.gate is not None:
            self.gate.leave(job.tenant)
        if not self.cfg.observe:
            return
        prefill = self.decodes[job.decode] if job.local else self.prefills[job.prefill]
        decode = None if self.cfg.mixed else self.decodes[job.decode].id
        self.policy.observe(job_observation(job, prefill.id, decode))

    # -- the loop ---------------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest]) -> RunResult:
        wall0 = time.perf_counter()
        order = sorted(trace, key=lambda r: r.arrival_s)
        if order and order[0].block_tokens != 512:  # recorded traces: capacities stay in tokens
            self._resize_caches(order[0].block_tokens)
        t0 = order[0].arrival_s if order else 0.0
        self.jobs = jobs = [Job(i, r, (r.arrival_s - t0) / self.cfg.speedup) for i, r in enumerate(order)]
        events = self.events
        # Everything alive now (the trace, its jobs, the policy's models, every module) outlives the
        # run: frozen out of the collector, a full collection does not walk it (one took 60 ms of a
        # 1.9 s kvcache_aware run). Not where someone else froze objects: unfreezing would undo theirs
        freeze = gc.isenabled() and gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            for job in jobs:
                while events and events[0][0] <= job.arrival:
                    self._dispatch_event()
                self.now = job.arrival
                if self._enter(job):
                    self._decide(job, True)
            while events:
                self._dispatch_event()
        finally:
            if freeze:
                gc.unfreeze()
        return run_result(self, jobs, time.perf_counter() - wall0)

    def _resize_caches(self, block_tokens: int) -> None:
        for p in self._cached:
            p.cache = BlockLRU(self.cfg.prefill_cache_tokens, block_tokens)
        self.store = BlockLRU(self.cfg.store_capacity_tokens, block_tokens)
        self._indexes = index_caches(self._cached, self._index_delay, self.cfg.prefill_cache_tokens, block_tokens)

    def _dispatch_event(self) -> None:
        t, _, kind, target, payload = heapq.heappop(self.events)
        self.now = t
        if kind == _PREFILL_DONE:
            self._prefill_done(target)
        elif kind == _PULL_READY:
            self._try_start(target)
        elif kind == _DECODE_ARRIVE:
            assert isinstance(payload, Job)
            self._decode_arrive(target, payload)
        elif kind == _FIRST_TOKEN:  # a mixed worker's first token: its leg, as the gateway tells it
            assert self._leg_observer is not None and isinstance(payload, Job)
            self._leg_observer.observe_prefill_leg(mixed_leg(payload, self.decodes[target].id))
        elif kind == _HOLD_WAKE:
            for held in self.room.woken():
                self._decide(held, True)
        elif kind == _HOLD_DUE:
            assert isinstance(payload, Job)
            if self.room.held(payload):
                self._decide(payload, False)
        elif kind == _INDEXED:
            assert isinstance(payload, tuple)
            self._indexes[target][1].touch(payload)
        else:
            assert isinstance(payload, int)
            self._decode_tick(target, payload)


def simulate(policy: Policy, trace: Sequence[TraceRequest], config: SimConfig) -> RunResult:
    """Replay `trace` through `policy` on the cluster `config` describes."""
    return Simulator(policy, config).run(trace)
