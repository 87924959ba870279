"""Per-request choice between a disaggregated prefill and a prefill on the decode instance itself.

A vLLM decode engine in a P/D deployment (NixlConnector with kv_role kv_both, for one) computes a
request that carries no kv_transfer_params itself, as a mixed engine would: no prefill queue, no KV
handoff, but every stream decoding there waits while that prefill runs (the emulator's and the
simulator's engine step is the prefill plus the batch's step; a long prompt stalls the batch for
its whole prefill). On a prefill-bound cluster whose decodes have TBT to spare, sending the short
uncached prompts there adds prefill capacity the prefill pool lacks (llm-d's selective P/D and
Dynamo's conditional disaggregation do the same by a prompt-length threshold; here the choice is
made on the predictions).

`LocalPrefill.plan` weighs every decode for one request: the predicted wait behind the prefills
already sent to it, the request's own prefill (the prefill model: decodes are assumed to be the
same hardware), and the TBT its streams would see, `tbt / (1 - duty)`, where `duty` is the share
of the last `window_s` seconds the decode spends on local prefills, this one included. It plans
one only for a prompt of at most `max_tokens` uncached tokens, on a decode whose duty stays within
`max_duty` and whose TBT so stretched meets the request's TBT SLO; the policy then takes it where
its TTFT beats `gain` times the disaggregated one, or where the disaggregated one is rejected,
unless the disaggregated placement reuses half the prompt or more.

What it remembers (the local prefills it sent, per decode, over `window_s`) changes in `record`
only, which the policy calls from its `on_decided`; bounded by the window and `max_entries`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from conductor.core.types import CandidateScore, Decision, InstanceView, RequestView
from policies.estimate import stall_fits
from predictors.online import Predictors


@dataclass(frozen=True, slots=True)
class LocalPlan:
    """A prefill on a decode instance, as predicted.

    decode: the decode instance that would compute and decode the request.
    queue_s: predicted wait behind the local prefills already sent there.
    prefill_s: predicted prefill of the whole prompt there (nothing cached: the KV index follows
        prefill instances only).
    ttft_s: queue_s + prefill_s + one decode step.
    tbt_s: the decode's predicted TBT with this request, stretched by the duty.
    duty: share of `window_s` that decode would spend on local prefills, this one included.
    """

    decode: InstanceView
    queue_s: float
    prefill_s: float
    ttft_s: float
    tbt_s: float
    duty: float


class LocalPrefill:
    def __init__(
        self, max_tokens: int, *, max_duty: float = 0.15, window_s: float = 30.0, gain: float = 0.8, max_entries: int = 4096
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"local_prefill_tokens must be at least 1 (0 turns local prefills off), not {max_tokens}")
        if not 0.0 < max_duty < 1.0:
            raise ValueError(f"local_prefill_duty must be in (0, 1), not {max_duty!r}")
        if window_s <= 0:
            raise ValueError(f"the local prefill window must be positive, not {window_s!r}")
        if not 0.0 < gain <= 1.0:
            raise ValueError(f"local_prefill_gain must be in (0, 1], not {gain!r}")
        self.max_tokens, self.max_duty, self.window_s, self.gain = max_tokens, max_duty, window_s, gain
        self._max_entries = max(1, max_entries)
        self._sent: dict[str, deque[tuple[float, float]]] = {}  # decode -> (sent at, predicted seconds)

    def busy_s(self, decode: str, now: float) -> float:
        """Predicted seconds of local prefill sent to `decode` in the last `window_s`."""
        sent = self._sent.get(decode)
        if not sent:
            return 0.0
        while sent and sent[0][0] <= now - self.window_s:
            sent.popleft()
        if not sent:
            del self._sent[decode]
            return 0.0
        return sum(s for _, s in sent)

    def plan(
        self, pred: Predictors, request: RequestView, decodes: Sequence[InstanceView], tbts: Sequence[float], now: float
    ) -> LocalPlan | None:
        """The decode with the lowest predicted TTFT for a local prefill of `request`, or None.
        `tbts[i]`: the predicted TBT of `decodes[i]` once the request joins (its load now)."""
        new = request.prompt_tokens
        if new > self.max_tokens or not decodes:
            return None
        prefill_s = pred.prefill_s(new, 0)
        slo = request.slo.tbt_s
        best: LocalPlan | None = None
        for d, tbt in zip(decodes, tbts, strict=True):
            duty = (self.busy_s(d.id, now) + prefill_s) / self.window_s
            if duty > self.max_duty:
                continue
            stretched = tbt / (1.0 - duty)
            if slo is not None and (stretched > slo or not stall_fits(d, prefill_s, slo - tbt, slo, now)):
                continue
            queue_s = pred.queue_s(d.prefill_queue)
            ttft = queue_s + prefill_s + tbt
            if best is None or ttft < best.ttft_s:
                best = LocalPlan(d, queue_s, prefill_s, ttft, stretched, duty)
        return best

    def worth_it(
        self,
        plan: LocalPlan,
        disaggregated_ttft_s: float,
        disaggregated_rejected: bool,
        disaggregated_cached: int,
        prompt_tokens: int,
    ) -> bool:
        """Take the local prefill: the disaggregated placement is rejected, or slower by 1/gain; never
        where that placement reuses half the prompt or more (computing it all on the decode would
        cost more than the prefill pool saves, and the prefix's holder is where it belongs)."""
        if 2 * disaggregated_cached >= prompt_tokens:
            return False
        return disaggregated_rejected or plan.ttft_s < self.gain * disaggregated_ttft_s

    def record(self, decode: str, now: float, prefill_s: float) -> None:
        """A local prefill of `prefill_s` predicted seconds was sent to `decode` at `now`."""
        self.busy_s(decode, now)  # drops what left the window
        sent = self._sent.setdefault(decode, deque())
        sent.append((now, prefill_s))
        while len(sent) > self._max_entries:
            sent.popleft()


def local_decision(
    plan: LocalPlan, request: RequestView, policy: str, weighed: tuple[CandidateScore, ...], unlisted: int
) -> Decision:
    """The decision for a local prefill: `prefill` and `decode` both name the decode instance; the
    local candidate comes first, then what the disaggregated placement weighed (for the log)."""
    d = plan.decode
    local = CandidateScore(
        d.id,
        d.role,
        plan.ttft_s,
        plan.ttft_s,
        plan.tbt_s,
        {
            "queue_s": plan.queue_s,
            "transfer_s": 0.0,
            "prefill_s": plan.prefill_s,
            "cached_tokens": 0.0,
            "handoff_s": 0.0,
            "local_prefill_duty": plan.duty,
        },
    )
    return Decision(
        request_id=request.request_id,
        policy=policy,
        prefill=d.id,
        decode=d.id,
        predicted_ttft_s=plan.ttft_s,
        predicted_tbt_s=plan.tbt_s,
        candidates=(local, *weighed),
        unlisted_candidates=unlisted,
    )


def local_prefill_s(decision: Decision) -> float:
    """The predicted prefill seconds of a local decision (its first candidate, local_decision)."""
    return decision.candidates[0].detail.get("prefill_s", 0.0) if decision.candidates else 0.0
