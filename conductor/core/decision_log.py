"""Decisions as log records: plain JSON-safe dicts, never prompt text (a Decision holds none).

The gateway writes one record per decision to the `conductor.decisions` logger; the record's shape
is the one `tests/conductor/core/test_decision_log.py` checks, and the same function serves the
simulator and any tool that wants to read decisions back.
"""

from __future__ import annotations

import math
from typing import Any

from conductor.core.types import CandidateScore, Decision


def json_number(x: float | None) -> float | None:
    """A figure as the decision log writes it: rounded to 6 places, None when not finite (JSON has
    no infinity); conductor/routing/explain.py writes its figures so too, to compare equal."""
    if x is None or not math.isfinite(x):
        return None
    return round(x, 6)


_num = json_number


def _candidate(c: CandidateScore) -> dict[str, Any]:
    out: dict[str, Any] = {"instance": c.instance_id, "role": c.role.value, "score": _num(c.score)}
    if c.predicted_ttft_s is not None:
        out["predicted_ttft_s"] = _num(c.predicted_ttft_s)
    if c.predicted_tbt_s is not None:
        out["predicted_tbt_s"] = _num(c.predicted_tbt_s)
    for key, value in c.detail.items():
        out[key] = _num(value)
    return out


def decision_log_record(
    decision: Decision,
    prompt_tokens: int | None = None,
    model: str | None = None,
    *,
    priority: str | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """One structured log line for the gateway's decision logger (`prompt_tokens`: the prompt's size,
    `model`: the model it was routed for (a served name, never an alias), when the caller knows them;
    `priority`, `tenant`: the request's class and tenant, in the record only where configured;
    sizes and predictions only, never text)."""
    record: dict[str, Any] = {
        "request_id": decision.request_id,
        "model": model,
        "prompt_tokens": prompt_tokens,
        "policy": decision.policy,
        "prefill": decision.prefill,
        "decode": decision.decode,
        "rejected": decision.rejected,
        "predicted_ttft_s": _num(decision.predicted_ttft_s),
        "predicted_tbt_s": _num(decision.predicted_tbt_s),
        "pull_from": decision.pull_from,
        "pull_tokens": decision.pull_tokens,
        "candidates": [_candidate(c) for c in decision.candidates],
        "unlisted_candidates": decision.unlisted_candidates,  # instances estimated but not listed (policy option)
    }
    if priority is not None:
        record["priority"] = priority
    if tenant is not None:
        record["tenant"] = tenant
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
