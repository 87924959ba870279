"""Helpers shared by the built-in policies, and decisions as log records (`decision_log_record`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from policies.types import (
    CandidateScore,
    ClusterSnapshot,
    Decision,
    InstanceView,
    Observation,
    Rejection,
    RequestView,
    Role,
)

NO_INSTANCE = "no_instance"


class BasePolicy:
    """Policies without fitted state need not observe anything."""

    name = "base"

    def observe(self, observation: Observation) -> None:
        return None


def no_instance(request: RequestView, policy: str, role: Role) -> Decision:
    """A decision that says no healthy instance of `role` can take the request (HTTP 503)."""
    return Decision(
        request_id=request.request_id,
        policy=policy,
        rejection=Rejection(reason=NO_INSTANCE, message=f"no healthy {role.value} instance", retry_after_s=5.0),
    )


def pools(cluster: ClusterSnapshot) -> tuple[tuple[InstanceView, ...], tuple[InstanceView, ...], bool]:
    """(prefill-capable, decode, disaggregated): mixed workers form the first pool when no P/D."""
    prefill = cluster.by_role(Role.PREFILL)
    decode = cluster.by_role(Role.DECODE)
    if prefill or decode:
        return prefill, decode, True
    return cluster.by_role(Role.MIXED), (), False


def missing_pool(
    request: RequestView,
    policy: str,
    prefill: Sequence[InstanceView],
    decode: Sequence[InstanceView],
    disaggregated: bool,
) -> Decision | None:
    """The 503 decision when a pool the request needs is empty, else None."""
    if not prefill:
        return no_instance(request, policy, Role.PREFILL if disaggregated else Role.MIXED)
    if disaggregated and not decode:
        return no_instance(request, policy, Role.DECODE)
    return None


def local_prefix(request: RequestView, instance_id: str) -> int:
    """Leading prompt tokens an instance holds in its own memory (device or host tier)."""
    p = request.cached.get(instance_id)
    return 0 if p is None or p.tier.value == "store" else min(p.tokens, request.prompt_tokens)


def decided(
    request: RequestView,
    policy: str,
    prefill: str,
    decode: str | None,
    candidates: tuple[CandidateScore, ...] = (),
    rejection: Rejection | None = None,
) -> Decision:
    if rejection is not None:
        return Decision(request_id=request.request_id, policy=policy, rejection=rejection, candidates=candidates)
    return Decision(request_id=request.request_id, policy=policy, prefill=prefill, decode=decode, candidates=candidates)


# ---- decisions as log records: plain JSON-safe dicts, never prompt text (a Decision holds none)


def _num(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, 6)


def _candidate(c: CandidateScore) -> dict[str, Any]:
    out: dict[str, Any] = {"instance": c.instance_id, "role": c.role.value, "score": _num(c.score)}
    if c.predicted_ttft_s is not None:
        out["predicted_ttft_s"] = _num(c.predicted_ttft_s)
    if c.predicted_tbt_s is not None:
        out["predicted_tbt_s"] = _num(c.predicted_tbt_s)
    for key, value in c.detail.items():
        out[key] = _num(value)
    return out


def decision_log_record(decision: Decision) -> dict[str, Any]:
    """One structured log line for the gateway's decision logger."""
    record: dict[str, Any] = {
        "request_id": decision.request_id,
        "policy": decision.policy,
        "prefill": decision.prefill,
        "decode": decision.decode,
        "rejected": decision.rejected,
        "predicted_ttft_s": _num(decision.predicted_ttft_s),
        "predicted_tbt_s": _num(decision.predicted_tbt_s),
        "pull_from": decision.pull_from,
        "pull_tokens": decision.pull_tokens,
        "candidates": [_candidate(c) for c in decision.candidates],
    }
    r = decision.rejection
    if r is not None:
        record["rejection"] = {
            "reason": r.reason,
            "message": r.message,
            "predicted_s": _num(r.predicted_s),
            "slo_s": _num(r.slo_s),
            "retry_after_s": _num(r.retry_after_s),
        }
    return record
