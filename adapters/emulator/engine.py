"""The emulated engine: an FCFS prefill queue and a continuously batched decode loop.

One engine step at a time, as vLLM's scheduler runs them: a step takes at most one waiting request
into prefill (FCFS; the running batch limit is `max_num_seqs`) and advances every running sequence
by one token. The step lasts what the profile says -- T_prefill(new, cached) for a prefill,
TBT(batch, resident KV) for decodes, T_prefill + (TBT - decode_base) for both (the decodes ride in
the prefill's batch) -- unless effects.py's options (chunked prefill, mixed-batch interference, KV
pressure) say otherwise. New sequences join the batch at step boundaries, so queueing delay is real
and shows up in TTFT.

A decode leg whose KV comes from a remote prefill (P/D) waits outside the step loop (vLLM's
WAITING_FOR_REMOTE_KVS): first for the prefill to be done (`remote_wait`), then for the transfer of
the prompt's uncached KV; then the received blocks land in this instance's prefix cache and the
sequence joins the batch, its first token sampled at the next step.

A prefill leg given a decode's KV to read back (bidirectional NIXL, readback.py) also waits outside
the loop: its local hit is pinned, the `pull` decides and reads, the transfer of the pulled tokens
takes its modelled time, the pulled full blocks land in the prefix cache (KV events), and then it
queues for the prefill of the rest (`preloaded`). A finished sequence marked `pin_on_finish` keeps
its blocks (a bidirectional decode's KV waiting to be read back) until `unpin`.

Each sequence carries the content seed of the KV it runs on (kv_content.py): its own prompt's, or
the one its remote prefill reported, which is what the generated text is computed from.

Each sequence also records the times the engine *modelled* for it (`modelled_*`: profile times with
time scale and noise applied, i.e. what the steps were meant to last): a busy host stretches the
wall-clock steps, never these figures, so tests check them exactly against the profile. The queue
figure counts the modelled steps it waited through, plus what was left of the step running when it
arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable

from adapters.emulator.effects import TimingEffects
from adapters.emulator.kv_content import PulledKv, RemoteKv, content_seed, received_taint
from adapters.emulator.kv_events import KvEventPublisher, all_blocks_cleared, events_for
from adapters.emulator.lora import LoraAdapter
from adapters.emulator.metrics import EngineMetrics
from adapters.emulator.prefix_cache import CacheChanges, PrefixCache
from adapters.emulator.profile import Profile
from adapters.emulator.sequence import Sequence
from adapters.tasks import cancel_and_wait
from conductor.core.vllm_hash import VllmBlockHasher

# Awaited by a remote-KV decode leg before its transfer starts; None means "no remote KV, prefill here".
RemoteWait = Callable[[], Awaitable[RemoteKv | None]]
# Awaited by a prefill leg that may read KV back from a decode, given its local hit in tokens; None:
# nothing pulled (below the threshold, covered, or a load failure), compute it all here.
KvPull = Callable[[Sequence, int], Awaitable[PulledKv | None]]
NO_EFFECTS = TimingEffects()
_SPIN_S = 0.0015  # the last stretch of a step is spun on loop.time(): asyncio.sleep overshoots by ~1 ms


class Engine:
    """Owns the scheduler state; everything runs on the event loop that called `start()`."""

    def __init__(
        self,
        profile: Profile,
        hasher: VllmBlockHasher,
        cache: PrefixCache,
        metrics: EngineMetrics,
        publisher: KvEventPublisher | None = None,
        *,
        time_scale: float = 1.0,
        noise: float = 0.0,
        seed: int | None = None,
        scheduling_policy: str = "fcfs",
        effects: TimingEffects = NO_EFFECTS,
    ) -> None:
        self.profile = profile
        self.effects = effects  # timing the predictors' formula lacks (effects.py); off by default
        # vLLM's --scheduling-policy: "fcfs", or "priority" (the waiting request of the lowest
        # (priority, arrival) goes first: a request can jump the queue, never the running step)
        self.by_priority = scheduling_policy == "priority"
        self.hasher = hasher
        self.cache = cache
        self.metrics = metrics
        self.publisher = publisher
        self.time_scale = time_scale
        self.noise = noise
        self._rng = random.Random(seed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefilling: Sequence | None = None  # a prompt whose chunked prefill is in progress
        self._remote: dict[Sequence, asyncio.Task[None]] = {}  # legs waiting for remote KV
        self._pinned: set[Sequence] = set()  # finished, blocks kept (pin_on_finish)
        self.on_pinned: Callable[[Sequence], None] | None = None  # told of each sequence pinned
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pending = CacheChanges()
        self.steps = 0
        self._arrivals = 0
        self._step_end: float | None = None  # loop time the running step is modelled to end at

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        for task in [self._task, *self._remote.values()]:
            await cancel_and_wait(task)
        self._task = None

    # -- requests ----------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        remote_wait: RemoteWait | None = None,
        *,
        pull: KvPull | None = None,
        pin_on_finish: bool = False,
        priority: int = 0,
        sample: int = 0,
        pooling: bool = False,
        lora: LoraAdapter | None = None,
    ) -> Sequence:
        loop = asyncio.get_running_loop()
        seq = Sequence(
            request_id,
            prompt,
            max(1, max_tokens),
            self.hasher.digests(prompt, None if lora is None else lora.extra_keys),
            loop.time(),
            content_seed(prompt),
            sample=sample,
            pooling=pooling,
            lora=lora,
            arrival_index=self._arrivals,
            pin_on_finish=pin_on_finish,
            priority=priority,
        )
        self._arrivals += 1
        if self._step_end is not None:  # it waits for the rest of the step running now
            seq.modelled_queue_s = max(0.0, self._step_end - seq.arrival)
        if remote_wait is None and pull is None:
            self.waiting.append(seq)
            self._wake.set()
        else:
            if remote_wait is not None:
                task = loop.create_task(self._receive_remote(seq, remote_wait))
            else:
                assert pull is not None
                task = loop.create_task(self._pull(seq, pull))
            self._remote[seq] = task
            task.add_done_callback(functools.partial(self._remote_done, seq))
        self.metrics.waiting.set(len(self.waiting) + len(self._remote))
        return seq

    @property
    def waiting_for_remote(self) -> int:
        """Decode legs waiting for their prefill or KV transfer (vLLM's WAITING_FOR_REMOTE_KVS)."""
        return len(self._remote)

    def _remote_done(self, seq: Sequence, _task: asyncio.Task[None]) -> None:
        self._remote.pop(seq, None)

    @property
    def pinned(self) -> int:
        """Finished sequences whose blocks are kept for a readback."""
        return len(self._pinned)

    def unpin(self, seq: Sequence) -> None:
        """A pinned sequence's KV was read back or expired: its blocks become evictable."""
        if seq in self._pinned:
            self._pinned.discard(seq)
            self._release(seq)
            self._update_gauges()

    def abort(self, seq: Sequence) -> None:
        """The client went away: free the sequence's slot and blocks at once (vLLM aborts likewise)."""
        if seq.finished or seq.aborted:
            return
        seq.aborted = True
        remote = self._remote.pop(seq, None)
        if remote is not None:  # stop waiting for the prefill / transfer at once
            remote.cancel()
        with contextlib.suppress(ValueError):
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq is self._prefilling:
            self._prefilling = None
        self._release(seq)
        self.metrics.success_abort.inc()
        seq.tokens.put_nowait(None)
        self._update_gauges()

    def reset_cache(self) -> None:
        """Drop every cached block and announce AllBlocksCleared (vLLM's /reset_prefix_cache)."""
        self.cache.clear()
        for seq in [*self.running, *self.waiting, *self._remote, *self._pinned, *filter(None, [self._prefilling])]:
            seq.held_blocks = 0
        self._pending = CacheChanges()
        if self.publisher is not None:
            self.publisher.publish([all_blocks_cleared()])

    # -- timing --------------------------------------------------------------------------------
    def scaled(self, seconds: float) -> float:
        """Profile seconds -> wall seconds: time scale times multiplicative lognormal noise (mean 1)."""
        if self.noise > 0:
            seconds *= math.exp(self._rng.gauss(-self.noise * self.noise / 2, self.noise))
        return seconds * self.time_scale

    @staticmethod
    async def sleep_until(deadline: float) -> None:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining > _SPIN_S:
            await asyncio.sleep(remaining - _SPIN_S)
        while loop.time() < deadline:  # noqa: ASYNC110 - a deliberate spin: sleep() overshoots by ~1 ms
            await asyncio.sleep(0)

    # -- internals -----------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        if seq.held_blocks:
            self.cache.release(seq.digests[: seq.held_blocks])
            seq.held_blocks = 0

    def _admit(self, seq: Sequence, hit_blocks: int) -> None:
        """Pin the cache hit and cache (pin) the rest of the prompt's full blocks."""
        self.cache.acquire(seq.digests[:hit_blocks])
        held, changes = self.cache.insert(seq.digests, seq.prompt, hit_blocks, seq.lora)
        seq.held_blocks = hit_blocks + held
        self._pending.extend(changes)

    def _flush_events(self) -> None:
        if self.publisher is not None and (self._pending.stored or self._pending.removed):
            self.publisher.publish(events_for(self._pending, self.cache.block_size))
        self._pending = CacheChanges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting) + len(self._remote))
        self.metrics.kv_usage.set(self.cache.usage())

    async def _receive_remote(self, seq: Sequence, remote_wait: RemoteWait) -> None:
        loop = asyncio.get_running_loop()
        remote = await remote_wait()
        if remote is None or seq.aborted:
            if not seq.aborted:  # no remote KV after all: prefill locally
                self.waiting.append(seq)
                self._wake.set()
            return
        if remote.seed is not None:  # the KV that arrives is that prompt's, whatever this prompt is
            seq.kv_seed = remote.seed
            seq.kv_taint = received_taint(remote, seq.prompt, self.cache.block_size)
        hit = self.cache.hit_blocks(seq.digests, seq.prompt_tokens)
        seq.cached_tokens = hit * self.cache.block_size
        seq.external_tokens = seq.prompt_tokens - seq.cached_tokens
        seq.modelled_transfer_s = self.scaled(self.profile.transfer_s(seq.external_tokens))
        await self.sleep_until(loop.time() + seq.modelled_transfer_s)
        if seq.aborted:
            return
        self._admit(seq, hit)
        self._flush_events()  # the received blocks are announced when they land
        seq.scheduled_at = loop.time()
        self.metrics.prompt(seq.prompt_tokens, seq.cached_tokens, seq.external_tokens)
        self.running.append(seq)
        self._update_gauges()
        self._wake.set()

    async def _pull(self, seq: Sequence, pull: KvPull) -> None:
        """A prefill leg reading KV back from a decode, then queueing for the prefill of the rest."""
        loop = asyncio.get_running_loop()
        size = self.cache.block_size
        hit = self.cache.hit_blocks(seq.digests, seq.prompt_tokens)
        self.cache.acquire(seq.digests[:hit])  # held across the transfer, as vLLM allocates before loading
        seq.held_blocks = hit
        pulled = await pull(seq, hit * size)
        if seq.aborted:
            return
        if pulled is not None:
            seq.modelled_queue_s = 0.0  # the wait before the transfer is the transfer's, not the queue's
            seq.modelled_transfer_s = self.scaled(self.profile.transfer_s(pulled.tokens))
            await self.sleep_until(loop.time() + seq.modelled_transfer_s)
            if seq.aborted:
                return
            # a reset during the transfer dropped the local hit: what is held now is where to insert from
            start = seq.held_blocks
            end = (hit * size + pulled.tokens) // size  # only full blocks are cached
            held, changes = self.cache.insert(seq.digests[:end], seq.prompt, start, seq.lora)
            seq.held_blocks = start + held
            self._pending.extend(changes)
            self._flush_events()  # the pulled blocks are announced when they land
            seq.cached_tokens, seq.external_tokens = start * size, pulled.tokens
            seq.kv_taint, seq.kv_seed = pulled.taint, pulled.seed
            seq.preloaded = True
            if self._step_end is not None:
                seq.modelled_queue_s = max(0.0, self._step_end - loop.time())
        else:  # prefilled like any request: the step takes its own hit
            self._release(seq)
        self.waiting.append(seq)
        self._wake.set()

    def _emit(self, seq: Sequence, now: float) -> None:
        """One token for `seq`; finishes it at max_tokens."""
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft.observe(now - seq.arrival)
        elif seq.last_token_at is not None:
            self.metrics.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        seq.tokens.put_nowait(seq.generated)
        seq.generated += 1
        if not seq.pooling:  # an embedding's forward pass samples no token
            self.metrics.generation_tokens.inc()
        if seq.generated >= seq.max_tokens:
            seq.finished = True
            if seq.pin_on_finish and self.on_pinned is not None:
                self._pinned.add(seq)
                self.on_pinned(seq)  # before the end of the token stream: the answer can name the pin
            else:
                self._release(seq)
            seq.tokens.put_nowait(None)
            self.metrics.finished(seq.times(now))

    def _next_waiting(self) -> Sequence:
        if not self.by_priority:
            return self.waiting.popleft()
        best = min(self.waiting, key=lambda q: (q.priority, q.arrival_index))
        self.waiting.remove(best)
        return best

    def _start_prefill(self, start: float) -> Sequence:
        """Take the next waiting request into prefill: pin its hit, cache the rest of its blocks."""
        prefill = self._next_waiting()
        prefill.scheduled_at = start
        if prefill.preloaded:  # its hit and pulled blocks are held: cache the rest
            held, changes = self.cache.insert(prefill.digests, prefill.prompt, prefill.held_blocks, prefill.lora)
            prefill.held_blocks += held
            self._pending.extend(changes)
        else:
            hit = self.cache.hit_blocks(prefill.digests, prefill.prompt_tokens)
            prefill.cached_tokens = hit * self.cache.block_size
            self._admit(prefill, hit)
        self.metrics.prompt(prefill.prompt_tokens, prefill.cached_tokens, prefill.external_tokens)
        return prefill

    def _step_s(self, prefill: Sequence | None, batch: list[Sequence]) -> tuple[float, int]:
        """The step's modelled duration (scaled) and the prefill chunk it computes (effects.py)."""
        kv = sum(s.prompt_tokens + s.generated for s in batch)
        chunk_at: tuple[int, int] | None = None
        if prefill is not None:
            have = prefill.cached_tokens + prefill.external_tokens + prefill.computed
            chunk_at = (self.effects.chunk(prefill.prompt_tokens - have, len(batch)), have)
        usage = (kv + (sum(chunk_at) if chunk_at else 0)) / (self.cache.capacity_blocks * self.cache.block_size)
        duration = self.effects.step_s(self.profile, chunk_at, len(batch), kv, usage)
        return self.scaled(duration), 0 if chunk_at is None else chunk_at[0]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running and self._prefilling is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            start = loop.time()
            prefill = self._prefilling  # a chunked prefill goes on first, as vLLM's running requests
            if prefill is None and self.waiting and len(self.running) < self.profile.max_num_seqs:
                prefill = self._prefilling = self._start_prefill(start)
            batch = list(self.running)
            self._update_gauges()
            step_s, chunk = self._step_s(prefill, batch)
            if prefill is not None:
                prefill.modelled_prefill_s = (prefill.modelled_prefill_s or 0.0) + step_s
                prefill.prefill_step = self.steps
            for waiting in self.waiting:
                waiting.modelled_queue_s += step_s
            self._step_end = start + step_s
            await self.sleep_until(self._step_end)
            self._step_end = None
            self.steps += 1
            now = loop.time()
            self._flush_events()
            for seq in batch:
                if not seq.aborted and not seq.finished:
                    self._emit(seq, now)
            self.running = [s for s in self.running if not s.finished and not s.aborted]
            if prefill is not None:
                prefill.computed += chunk
                have = prefill.cached_tokens + prefill.external_tokens + prefill.computed
                if prefill.aborted or have >= prefill.prompt_tokens:
                    self._prefilling = None
                if not prefill.aborted and have >= prefill.prompt_tokens:
                    self._emit(prefill, now)
                    if not prefill.finished:
                        self.running.append(prefill)
            self._update_gauges()
