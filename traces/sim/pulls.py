"""Planning a decision's prefix pull in the simulator: what it pulls, from where, and when it has arrived."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from conductor.core.types import Decision
from policies.estimate import STORE_SOURCE
from traces.sim.cluster import BlockLRU, Job, PrefillInstance
from traces.sim.config import SimConfig


def plan_pull(
    job: Job,
    decision: Decision,
    p: PrefillInstance,
    local_tokens: int,
    prefills: Sequence[PrefillInstance],
    p_index: Mapping[str, int],
    store: BlockLRU,
    cfg: SimConfig,
    now: float,
) -> bool:
    """Plan the pull `decision` asks of prefill `p` for `job` (its `pull_src`, `pull_prefix` and
    `ready_at`, and the links it holds); True when the pull is refused for a mechanism the cluster
    lacks (SimConfig.pull). `Decision.pull_tokens` is what the prefill pulls on top of the prefix it
    holds itself (conductor.core.types: "tokens of that prefix it pulls instead of recomputing"), so
    the prefix it works from is its local one plus those, as far as the source holds them."""
    src = decision.pull_from
    if not src or decision.pull_tokens <= 0:
        return False
    req = job.req
    if src == STORE_SOURCE:
        if not cfg.pull_from_store:
            return True  # no store in this cluster's transfer setup
        held = store.match(req.hash_ids)
    elif src in p_index and src != p.id:
        if not cfg.pull_from_peer:
            return True
        held = prefills[p_index[src]].cache.match(req.hash_ids)
    else:
        return False
    avail = min(held * req.block_tokens, req.input_length)
    prefix = min(local_tokens + decision.pull_tokens, avail)
    if prefix <= local_tokens:
        return False
    job.pull_src, job.pull_prefix = src, prefix
    truth = cfg.truth
    if src == STORE_SOURCE:
        start = max(now, p.link_free)
        job.ready_at = p.link_free = start + truth.transfer_s(prefix - local_tokens)
    else:  # the holder's outbound link too: pulls of one hot prefix queue behind each other
        holder = prefills[p_index[src]]
        staged = holder.staged_at(cfg.staging, now, prefix, truth.prefill_s)
        start = max(now, p.link_free, holder.out_free, staged)
        job.ready_at = p.link_free = holder.out_free = start + truth.transfer_s(prefix - local_tokens)
    return False
