"""The views of the simulated instances a policy is given, rebuilt no more often than they change.

A decode instance's view changes as its streams generate and as requests are routed to it; a
prefill's as its queue changes and as its running head's elapsed time moves. Each is cached on
the instance with the version it was built at and rebuilt when the version moved or the view is
older than `SimConfig.snapshot_refresh_s` (building every queue for every arrival is quadratic
under overload). The values are built by traces/sim/views.py's slot-storing builders.
"""

from __future__ import annotations

from collections.abc import Sequence

from conductor.core.types import ActiveDecode, CachedPrefix, ClusterSnapshot, InstanceView, QueuedPrefill, RequestView, Role
from traces.sim.cluster import BlockLRU, Cached, DecodeInstance, Job, PrefillInstance
from traces.sim.config import SimConfig
from traces.sim.views import active_decode, cluster_snapshot, instance_view, queued_prefill, request_view


def request_view_of(
    job: Job,
    indexes: Sequence[tuple[Cached, BlockLRU]],
    prefixes: dict[int, CachedPrefix],
    store: BlockLRU | None,
    cfg: SimConfig,
    staged_sources: frozenset[str],
    staging_jumps: bool,
) -> RequestView:
    """The job's RequestView: what the KV `indexes` report each instance holds of it (one shared
    CachedPrefix per size, kept in `prefixes`) and the `store` (None: not indexed), its class's SLO,
    class and tenant (SimConfig.classes), its session (SimConfig.sessions)."""
    req = job.req
    hash_ids, block_tokens, prompt = req.hash_ids, req.block_tokens, req.input_length
    cached = {}
    for p, index in indexes:
        n = index.match(hash_ids)
        if n:
            tokens = n * block_tokens
            if tokens > prompt:  # min(tokens, prompt), inline (8 or more per arrival)
                tokens = prompt
            prefix = prefixes.get(tokens)
            if prefix is None:
                prefix = prefixes[tokens] = CachedPrefix(tokens)
            cached[p.id] = prefix
    aware = cfg.index_delay_s is not None  # else KV awareness is off: no block keys either
    stored = min(store.match(hash_ids) * block_tokens, prompt) if store is not None else 0
    return request_view(  # RequestView(..., stream=True), built as its slots take it (traces/sim/views.py)
        f"r{job.seq}",
        job.seq,
        cfg.model,
        prompt,
        job.output_tokens,
        block_tokens,
        hash_ids if aware else (),
        cached,
        stored,
        job.slo or cfg.slo,
        staged_sources,
        staging_jumps,
        req.session if cfg.sessions else None,
        job.cls,
        job.tenant,
    )


def decode_view(d: DecodeInstance, now: float, cfg: SimConfig) -> InstanceView:
    """The decode instance's view now (a mixed worker's with SimConfig.mixed: its local prefills as
    its prefill queue): its cached one while fresh (same version, inside the refresh interval), else
    rebuilt, each stream's entry rebuilt only as it generates."""
    if d.view_version != d.version or now - d.view_at > cfg.snapshot_refresh_s or not d.view:
        d.advance(now)
        streams, local = [], []
        active, steps = d.active, d.steps
        for j in d.assigned.values():
            if j.seq in active:
                gen = int(steps - j.start_step)
                entry = j.decode_view
                if entry is None or j.view_gen != gen:  # a stream's entry changes only as it generates
                    j.view_gen = gen
                    # the stream as a gateway relaying it sees it: its tokens so far and its first's time
                    entry = j.decode_view = active_decode(
                        j.req.input_length + gen, max(0, j.output_tokens - gen), True, gen, j.first_token
                    )
                streams.append(entry)
                if j.local == 2 and j.prefill_done > now:  # its local prefill: still stalling the batch
                    local.append(queued_prefill(j.est_new, j.est_cached, max(0.0, now - j.prefill_start)))
            elif cfg.routed_in_decode_view:  # routed here: in prefill, transfer or waiting for KV space
                if j.pending_view is None:  # the same until it decodes: built once
                    j.pending_view = ActiveDecode(j.req.input_length, j.output_tokens, decoding=False)
                streams.append(j.pending_view)
            if j.local == 1:  # waiting for KV space, its prefill not started
                local.append(QueuedPrefill(j.est_new, j.est_cached, 0.0))
        d.view = (
            instance_view(  # InstanceView(...), built as fast as its slots take it (traces/sim/views.py)
                d.id,
                Role.MIXED if cfg.mixed else Role.DECODE,
                tuple(local),
                tuple(streams),
                d.truth.kv_capacity_tokens,
                d.usage(),
                len(d.waiting),
            ),
        )
        d.view_at, d.view_version = now, d.version
    view = d.view[0]
    assert isinstance(view, InstanceView)
    return view


def prefill_view(p: PrefillInstance, now: float, cfg: SimConfig) -> InstanceView:
    """The prefill instance's view now (its queue, the running head's elapsed time)."""
    # Rebuilt when the queue changed or the cached elapsed times are older than the refresh
    # interval: building every queue for every arrival is quadratic under overload.
    stale = now - p.view_at > cfg.snapshot_refresh_s
    if stale and not p.running and p.view is not None and p.view_version == p.version:
        p.view_at = now  # refreshed, to the same view: only a running head's entry moves with time
        return p.view
    if p.view is None or p.view_version != p.version or stale:
        # elapsed: the running head's time since it started (the only one the queue estimate
        # subtracts); from dispatch it would include its own wait and hide its remainder. Every
        # other entry is fixed from dispatch on: built once per job
        queue = p.queue
        entries = []
        rest = iter(queue)
        if p.running:
            head = next(rest)
            entries.append(queued_prefill(head.est_new, head.est_cached, now - head.prefill_start))
        for j in rest:
            if j.queued_view is None:
                j.queued_view = QueuedPrefill(j.est_new, j.est_cached, 0.0)
            entries.append(j.queued_view)
        p.view = instance_view(
            p.id,
            Role.PREFILL,
            tuple(entries),
            (),
            None,
            None,
            len(p.queue) - (1 if p.running else 0),
        )
        p.view_at, p.view_version = now, p.version
    return p.view


def cluster_view(
    prefills: Sequence[PrefillInstance], decodes: Sequence[DecodeInstance], now: float, cfg: SimConfig
) -> ClusterSnapshot:
    """The ClusterSnapshot a policy is given at `now`: every prefill's view, then every decode's."""
    # a view still fresh (same version, inside the refresh interval) is taken here without the
    # call that would rebuild it: most of the sixteen are, at most arrivals
    refresh = cfg.snapshot_refresh_s
    views = []
    for p in prefills:
        view = p.view
        if view is None or p.view_version != p.version or now - p.view_at > refresh:
            view = prefill_view(p, now, cfg)
        views.append(view)
    for d in decodes:
        if d.view_version != d.version or now - d.view_at > refresh or not d.view:
            views.append(decode_view(d, now, cfg))
        else:
            views.append(d.view[0])  # type: ignore[arg-type]  # an InstanceView (_decode_view)
    return cluster_snapshot(now, tuple(views))
