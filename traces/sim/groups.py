"""A run's results per priority class and per tenant (SimConfig.classes), scored as benchmarks/tenants_load.py scores a live run.

Groups: "all", "class:<c>", "tenant:<t>" and "tenant:<t>/<c>" (a request without a tenant is in the
first two only). Per group: `sent`; `admitted`, not refused before it reached a worker (a 429 or
the in-flight limit's 503: the policy's rejections, the shares' `priority_shed` / `tenant_share`,
and the simulator's own `queue_full`; a request the decode guard refuses after its prefill was
admitted and missed, as a failed request is live); `met`, finished within its class's TTFT and
mean-TBT SLOs; their shares `admitted_share`, `met_admitted` (1 when nothing was admitted: nothing
missed) and `met_sent`; and `missed:<why>` counts (the refusal's reason, else `late_ttft` or
`slow_tbt`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from conductor.core.types import Slo
from traces.sim.cluster import Job

ADMITTED_THEN_REFUSED = frozenset({"decode_overload"})  # refused after its prefill ran: admitted, missed


def miss_reason(job: Job, finished: bool, slo: Slo) -> str | None:
    """Why the job missed its SLOs (None: it met both); `finished`: it produced all its output."""
    if job.refused:
        return job.refused
    if not finished:
        return "unfinished"
    ttft = job.first_token - job.arrival
    if slo.ttft_s is not None and ttft > slo.ttft_s:
        return "late_ttft"
    out = job.output_tokens
    if out > 1 and slo.tbt_s is not None and (job.finish - job.first_token) / (out - 1) > slo.tbt_s:
        return "slow_tbt"
    return None


def group_scores(jobs: Iterable[Job], done: Iterable[Job], default_slo: Slo) -> dict[str, dict[str, float]]:
    """Group -> its figures (the module docstring), over every job of the run."""
    finished = {j.seq for j in done}
    counts: dict[str, dict[str, float]] = {}
    for job in jobs:
        why = miss_reason(job, job.seq in finished, job.slo or default_slo)
        groups = ["all"]
        if job.cls is not None:
            groups.append(f"class:{job.cls}")
        if job.tenant is not None:
            groups.append(f"tenant:{job.tenant}")
            if job.cls is not None:
                groups.append(f"tenant:{job.tenant}/{job.cls}")
        for name in groups:
            g = counts.setdefault(name, {"sent": 0.0, "admitted": 0.0, "met": 0.0})
            g["sent"] += 1
            g["admitted"] += not job.refused or job.refused in ADMITTED_THEN_REFUSED
            g["met"] += why is None
            if why is not None:
                g[f"missed:{why}"] = g.get(f"missed:{why}", 0.0) + 1
    return {name: _shares(g) for name, g in counts.items()}


def _shares(g: Mapping[str, float]) -> dict[str, float]:
    sent, admitted, met = g["sent"], g["admitted"], g["met"]
    return {
        **g,
        "admitted_share": admitted / sent if sent else 0.0,
        "met_admitted": met / admitted if admitted else 1.0,
        "met_sent": met / sent if sent else 0.0,
    }
