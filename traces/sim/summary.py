"""The RunResult of one simulation, summarised from the engine's finished jobs and counters."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from traces.sim.cluster import DecodeInstance, Job, PrefillInstance
from traces.sim.config import SimConfig
from traces.sim.groups import group_scores, miss_reason
from traces.sim.results import Dist, PredictionError, RunResult


class FinishedRun(Protocol):
    """What a summary reads of a simulator after its run (traces/sim/engine.py's Simulator)."""

    @property
    def cfg(self) -> SimConfig: ...

    @property
    def policy(self) -> object: ...

    @property
    def done(self) -> list[Job]: ...

    @property
    def prefills(self) -> Sequence[PrefillInstance]: ...

    @property
    def decodes(self) -> Sequence[DecodeInstance]: ...

    @property
    def rejections(self) -> Counter[str]: ...

    @property
    def wasted_prefill(self) -> int: ...

    @property
    def refused_pulls(self) -> int: ...

    @property
    def events_pushed(self) -> int: ...


def run_result(sim: FinishedRun, jobs: list[Job], wall_s: float) -> RunResult:
    """What the run produced: latencies of the finished jobs, SLO attainment (each job by its
    class's SLO, with SimConfig.classes) and goodput over the trace's span, hit rates, utilisation,
    prediction errors, the engine's counters and, with classes, the figures per class and tenant."""
    slo = sim.cfg.slo
    ttfts, tbts, met = [], [], 0
    pred_ttft, pred_tbt = [], []
    for j in sim.done:
        ttft = j.first_token - j.arrival
        out = j.output_tokens
        tbt = (j.finish - j.first_token) / (out - 1) if out > 1 else 0.0
        ttfts.append(ttft)
        if out > 1:
            tbts.append(tbt)
        if miss_reason(j, True, j.slo or slo) is None:
            met += 1
        if j.pred_ttft is not None:
            pred_ttft.append((j.pred_ttft, ttft))
        if j.pred_tbt is not None and out > 1:
            pred_tbt.append((j.pred_tbt, tbt))
    duration = max(1e-3, jobs[-1].arrival - jobs[0].arrival) if jobs else 1e-3
    makespan = max((j.finish for j in sim.done), default=0.0) - (jobs[0].arrival if jobs else 0.0)
    prompt = sum(j.req.input_length for j in sim.done) or 1
    util = {p.id: p.busy_s / makespan if makespan > 0 else 0.0 for p in sim.prefills}
    util.update({d.id: d.busy_s / makespan if makespan > 0 else 0.0 for d in sim.decodes})
    rejected = sum(sim.rejections.values())
    return RunResult(
        policy=getattr(sim.policy, "name", type(sim.policy).__name__),
        mode="simulate",
        n_prefill=len(sim.prefills),
        n_decode=len(sim.decodes),
        requests=len(jobs),
        completed=len(sim.done),
        rejected=rejected,
        rejections=dict(sim.rejections),
        ttft=Dist.of(ttfts),
        tbt=Dist.of(tbts),
        slo_ttft_s=slo.ttft_s,
        slo_tbt_s=slo.tbt_s,
        slo_met=met,
        slo_attainment=met / len(jobs) if jobs else 0.0,
        goodput_rps=met / duration,
        duration_s=duration,
        makespan_s=makespan,
        prefix_hit_local=sum(j.local_tokens for j in sim.done) / prompt,
        prefix_hit_remote=sum(j.pulled_remote for j in sim.done) / prompt,
        prefix_hit_store=sum(j.pulled_store for j in sim.done) / prompt,
        utilisation=util,
        ttft_prediction=PredictionError.of(pred_ttft),
        tbt_prediction=PredictionError.of(pred_tbt),
        wall_s=wall_s,
        groups=group_scores(jobs, sim.done, slo) if sim.cfg.classes is not None else {},
        extra={
            "events": float(sim.events_pushed),
            "mean_decode_batch": _mean(j.batch_at_join for j in sim.done),
            "wasted_prefills": float(sim.wasted_prefill),
            "refused_pulls": float(sim.refused_pulls),
            "preemptions": float(sum(d.preemptions for d in sim.decodes)),
            "local_prefills": float(sum(1 for j in sim.done if j.local)),  # run on a decode (_arrive_local)
            # served requests whose prefill read a prefix from another prefill instance (a peer pull)
            "peer_pulls": float(sum(1 for j in sim.done if j.pulled_remote > 0)),
            # what bounds goodput on a prefill-bound cluster: prefill seconds per served request
            # (its mix and its reuse) and how busy the prefills were
            "prefill_s_per_served": sum(p.busy_s for p in sim.prefills) / max(1, len(sim.done)),
            "served_prompt_mean": _mean(j.req.input_length for j in sim.done),
            "prefill_busy": _mean(util[p.id] for p in sim.prefills),
            **_session_counts(sim.policy),
        },
    )


def _session_counts(policy: object) -> dict[str, float]:
    """Admitted decisions of requests with a session, by what the session did to them
    (kvcache_aware's SessionTable.counts: policies/kvcache_aware/sessions.py); nothing for a policy
    without one."""
    table = getattr(policy, "sessions", None)
    counts = getattr(table, "counts", None)
    if not isinstance(counts, dict):
        return {}
    return {f"session_{name}": float(n) for name, n in counts.items()}


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return math.fsum(vals) / len(vals) if vals else 0.0
