"""Where would this request go now, and why: the routing explainer behind `POST /admin/explain`
(conductor/server/explain_route.py) and `conductor explain` (conductor/explain_cli.py).

`explain` runs what the request path runs up to its decision -- the prompt's analysis (tokens,
block keys, which instances hold a prefix; with a worker's /tokenize as the tokenizer, that worker
is asked to tokenize it, as for any request), other replicas' load where load sharing asks for it,
the pulls offered, the policy's decision on the cluster as it is now (`Router.propose`) -- and
stops there. Nothing is forwarded and no routing state changes: no sequence number is taken, the
policy is not told (`on_decided`: nothing in flight, no pending prediction, no rejection counted
towards a probe), nothing enters the registry's in-flight accounting or the KV index, no readback
handle is taken, no decision is logged or counted in the metrics. So explaining the same request
twice gives the same answer but for its own request id, and the request then sent is decided as
explained (the same placement and predictions, to the figure) while nothing else changes the
cluster meanwhile: the queues a prediction reads move with every request in flight.

What any read touches may move: a readback handle found expired is dropped (it could serve no
one), a shared (Redis) index's breaker and fallback counters see the look-up, and a registry whose
health has crossed its panic threshold logs it.

The value is the decision's placement, predictions and admission verdict, each candidate's
components as the policy weighed them (queue, transfer, prefill, handoff; a decode's batch), and
what the index and the pulls offered said of every instance; sizes and figures only, never the
prompt's text. `Explanation.to_json` writes figures as the decision log (`conductor.decisions`)
does, rounded alike, so the two compare equal.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conductor.core.decision_log import json_number
from conductor.core.errors import NoHealthyInstance, Overloaded, Rejected
from conductor.core.types import CandidateScore, Decision, Slo
from conductor.kv.analysis import PromptAnalysis, RequestKind
from conductor.routing.request_path import InflightLimit, RequestPath
from conductor.routing.router import Proposal
from policies.base import NO_INSTANCE

OVERLOADED = "overloaded"  # the verdict's reason when the gateway's own in-flight cap is reached


@dataclass(frozen=True, slots=True)
class CandidateExplanation:
    """One instance as the policy weighed it, with what the index and the pulls say of it."""

    instance: str
    role: str  # "prefill", "decode" or "mixed"
    chosen: bool  # the decision's prefill or decode
    score: float  # the policy's figure of merit; lower is better
    predicted_ttft_s: float | None  # a prefill-capable instance's TTFT there
    predicted_tbt_s: float | None  # a decode's TBT with the request joined
    indexed_cached_tokens: int  # leading prompt tokens the KV index says it holds
    pullable_tokens: int  # leading prompt tokens a prefill could pull from it (0: no pull offered)
    # the policy's named components: a prefill's queue_s, transfer_s, prefill_s, handoff_s,
    # cached_tokens and pulled_tokens (as placed there, in-flight prefixes counted); a decode's
    # batch, resident_kv_tokens, at_s and, for the chosen one, how admission judged it
    detail: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Admission's verdict and the HTTP status the request would get now."""

    admitted: bool
    status: int  # 200; 429 predicted to miss an SLO (or capacity); 503 no instance, or the gateway is full
    reason: str | None = None  # ttft_slo, tbt_slo, capacity, no_instance, overloaded
    message: str | None = None
    predicted_s: float | None = None  # the prediction the SLO was judged on
    slo_s: float | None = None
    retry_after_s: float | None = None
    retryable: bool = True  # False: the request alone misses the SLO; sending it again cannot help


@dataclass(frozen=True, slots=True)
class Explanation:
    """The decision the gateway would make for a request now, and why (module docstring)."""

    request_id: str  # the explanation's own id; the request, when sent, gets another
    seq: int  # the sequence number the next decision gets (round-robin policies rotate by it)
    policy: str
    model: str
    kind: RequestKind
    prompt_tokens: int
    exact: bool  # tokenized (or given as ids); False: estimated from its length
    max_tokens: int
    stream: bool
    slo_ttft_s: float | None
    slo_tbt_s: float | None
    verdict: Verdict
    prefill: str | None  # where it would go (None: rejected); prefill == decode: the decode prefills it
    decode: str | None
    predicted_ttft_s: float | None
    predicted_tbt_s: float | None
    pull_from: str | None  # the instance (or "store") the prefill would pull a prefix from
    pull_tokens: int
    store_cached_tokens: int  # leading tokens in the pooled store
    cached: Mapping[str, int]  # every instance the index says holds a prefix -> its leading tokens
    pullable: Mapping[str, int]  # every pull offered: source instance -> tokens a prefill would hold
    candidates: tuple[CandidateExplanation, ...]
    unlisted_candidates: int  # weighed but not listed (the policy lists the best few)
    inflight: int  # the gateway's requests between admission and their last byte
    inflight_limit: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict; figures rounded as the decision log rounds them."""
        v = self.verdict
        return {
            "request_id": self.request_id,
            "seq": self.seq,
            "policy": self.policy,
            "model": self.model,
            "kind": self.kind,
            "prompt_tokens": self.prompt_tokens,
            "exact": self.exact,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "slo": {"ttft_s": json_number(self.slo_ttft_s), "tbt_s": json_number(self.slo_tbt_s)},
            "verdict": {
                "admitted": v.admitted,
                "status": v.status,
                "reason": v.reason,
                "message": v.message,
                "predicted_s": json_number(v.predicted_s),
                "slo_s": json_number(v.slo_s),
                "retry_after_s": json_number(v.retry_after_s),
                "retryable": v.retryable,
            },
            "prefill": self.prefill,
            "decode": self.decode,
            "predicted_ttft_s": json_number(self.predicted_ttft_s),
            "predicted_tbt_s": json_number(self.predicted_tbt_s),
            "pull_from": self.pull_from,
            "pull_tokens": self.pull_tokens,
            "store_cached_tokens": self.store_cached_tokens,
            "cached": dict(self.cached),
            "pullable": dict(self.pullable),
            "candidates": [_candidate_json(c) for c in self.candidates],
            "unlisted_candidates": self.unlisted_candidates,
            "inflight": {"count": self.inflight, "limit": self.inflight_limit},
        }


def _candidate_json(c: CandidateExplanation) -> dict[str, Any]:
    return {
        "instance": c.instance,
        "role": c.role,
        "chosen": c.chosen,
        "score": json_number(c.score),
        "predicted_ttft_s": json_number(c.predicted_ttft_s),
        "predicted_tbt_s": json_number(c.predicted_tbt_s),
        "indexed_cached_tokens": c.indexed_cached_tokens,
        "pullable_tokens": c.pullable_tokens,
        "detail": {k: json_number(x) for k, x in c.detail.items()},
    }


async def explain(parts: RequestPath, kind: RequestKind, body: Mapping[str, Any], max_tokens: int, slo: Slo) -> Explanation:
    """The decision for a request body already validated (conductor/server/requests.py) as the
    request path would make it now, with nothing acted upon (module docstring)."""
    analysis = await parts.analyzer.analyse(kind, body)
    max_age_s = parts.settings.load_share.sync_max_age_s
    if max_age_s is not None:  # other replicas' load, as fresh as a real decision sees it
        await parts.load_share.refresh(max_age_s)
    request_id = f"explain-{os.urandom(8).hex()}"
    stream = bool(body.get("stream", False))
    proposal = parts.router.propose(request_id, str(body["model"]), max_tokens, stream, slo, analysis)
    return explanation(proposal, analysis, kind, parts.inflight)


def explanation(proposal: Proposal, analysis: PromptAnalysis, kind: RequestKind, inflight: InflightLimit) -> Explanation:
    """The Explanation of a proposal for a prompt so analysed, under the gateway's in-flight cap."""
    decision, view, offer = proposal.decision, proposal.view, proposal.pulls
    cached = {name: prefix.tokens for name, prefix in analysis.cached.items()}
    pullable = dict(offer.sources)
    return Explanation(
        request_id=view.request_id,
        seq=view.seq,
        policy=decision.policy,
        model=view.model,
        kind=kind,
        prompt_tokens=view.prompt_tokens,
        exact=analysis.exact,
        max_tokens=view.max_tokens,
        stream=view.stream,
        slo_ttft_s=view.slo.ttft_s,
        slo_tbt_s=view.slo.tbt_s,
        verdict=verdict(decision, inflight),
        prefill=decision.prefill,
        decode=decision.decode,
        predicted_ttft_s=decision.predicted_ttft_s,
        predicted_tbt_s=decision.predicted_tbt_s,
        pull_from=decision.pull_from,
        pull_tokens=decision.pull_tokens,
        store_cached_tokens=analysis.store_cached_tokens,
        cached=cached,
        pullable=pullable,
        candidates=tuple(_candidate(c, decision, cached, pullable) for c in decision.candidates),
        unlisted_candidates=decision.unlisted_candidates,
        inflight=inflight.count,
        inflight_limit=inflight.limit,
    )


def verdict(decision: Decision, inflight: InflightLimit) -> Verdict:
    """What admission says, in the order the request path asks: the gateway's in-flight cap first
    (checked before any decision), then the policy's rejection, if any."""
    if inflight.count >= inflight.limit:
        message = f"the gateway already has {inflight.count} requests in flight (limits.max_inflight_requests)"
        return Verdict(False, Overloaded.status, OVERLOADED, message, retry_after_s=1.0)
    r = decision.rejection
    if r is None:
        return Verdict(True, 200)
    status = NoHealthyInstance.status if r.reason == NO_INSTANCE else Rejected.status
    return Verdict(False, status, r.reason, r.message, r.predicted_s, r.slo_s, r.retry_after_s, r.retryable)


def _candidate(
    c: CandidateScore, decision: Decision, cached: Mapping[str, int], pullable: Mapping[str, int]
) -> CandidateExplanation:
    return CandidateExplanation(
        instance=c.instance_id,
        role=c.role.value,
        chosen=c.instance_id in (decision.prefill, decision.decode),
        score=c.score,
        predicted_ttft_s=c.predicted_ttft_s,
        predicted_tbt_s=c.predicted_tbt_s,
        indexed_cached_tokens=cached.get(c.instance_id, 0),
        pullable_tokens=pullable.get(c.instance_id, 0),
        detail=dict(c.detail),
    )
