"""What kvcache_aware predicted for each admitted request, and what its outcome teaches the predictors.

`OutcomeLearner.remember` keeps (boundedly) the predictions of an admitted request, read back from
the decision's own candidate scores, so that what is learned from is exactly what was logged;
`learn` compares them with the request's Observation, records the errors and feeds the predictors'
online refit. The policy calls both from its `on_decided` and `observe`; nothing else changes this
state. What each outcome teaches:

* prefill: every observed prefill leg (queue_and_prefill_s) is a sample. Behind an FCFS queue the
  leg is the running head's remainder plus the queued prefills plus its own, so leg + the head's
  elapsed time - the predicted prefix pull is linear in the prefill coefficients with the summed
  features of the queue and the request (predictors.params.queue_features / observe_leg). The model keeps
  learning under sustained load, when no leg runs on an empty queue. A mixed worker's leg (its
  first token) is learned with those features times the streams listed there at decision time and
  their context tokens (Predictors.observe_mixed_leg): its engine runs them in every chunk's step.
  A leg is learned once, as soon as it is told (`learn_leg`: a NIXL prefill's answer, a mixed
  stream's first token), else from the Observation (a non-streamed mixed answer).
* decode leg: TTFT at the client minus the prefill leg (KV handoff, the decode step in progress and
  the one that samples the first token, HTTP) is fitted as k0 + k1*handoff bytes + k2*TBT
  (Predictors.observe_decode_leg); k1 is the link's cost per byte, so the transfer model (handoffs
  and prefix pulls) learns from every request; the predicted TTFT is the leg plus this.
* TBT: the mean of the stream's token intervals, against the batch it joined (decode_batch + 1) and
  the resident KV then (decode_resident_kv_tokens plus its own prompt and half its output).
* calibrated bounds: observed / predicted TTFT (and TBT as admission judged it) go into bounded
  ratio windows (predictors.quantile); admission compares `ttft_quantile` (0.95) and
  `tbt_quantile` (0.9) upper bounds with the SLOs, so admitted requests near the bound still meet
  it; the exported p90 coverage is that of the same windows' 0.9 quantile, fixed at decision time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from conductor.core.types import CandidateScore, ClusterSnapshot, Decision, Observation, PrefillLeg, RequestView
from predictors.online import Predictors
from predictors.params import mixed_leg_features, prefill_features, queue_features


@dataclass(slots=True)  # not frozen: nothing changes one, and a frozen one costs twice as much to build
class _Pending:
    """What was predicted for an admitted request, kept until its observation arrives."""

    prefill: str
    decode: str | None
    cached_tokens: int
    queue_s: float
    transfer_s: float
    prefill_s: float
    ttft_s: float  # point prediction at the client: leg + decode leg (first_token_s)
    tbt_s: float | None
    queue_features: tuple[float, float, float]  # summed prefill features of the queue ahead
    head_elapsed_s: float  # how long the queue's head had been running at decision time
    handoff_s: float  # predicted P -> D KV transfer (0 for mixed workers)
    first_tbt_s: float  # TBT the decode leg was predicted with
    bounds: tuple[float, float, float]  # p90 bounds at decision time: ttft, leg, tbt (0: none)
    judged_tbt_s: float | None  # the TBT admission judged (early: the load now; predicted: at arrival)
    # Predictors.generation when predicted, (TTFT side, TBT side): ratios of a side whose model has
    # since moved (its windows cleared) are not kept
    generation: tuple[int, int]
    # a mixed worker's (resident context tokens, streams) listed at decision time; None: P/D
    sharing: tuple[float, float] | None = None
    leg_learned: bool = False  # learn_leg taught its prefill leg already: learn must not again


_NO_BOUNDS = (0.0, 0.0, 0.0)  # _Pending.bounds when no errors are recorded


def _chosen_candidates(decision: Decision) -> tuple[CandidateScore, CandidateScore | None] | None:
    """The chosen prefill's and decode's scores among a decision's candidates (prefill candidates
    carry a predicted TTFT, decode candidates a predicted TBT; a mixed worker appears as both)."""
    # plain loops: generator expressions cost more than the few candidates they look through
    prefill = decode = None
    for c in decision.candidates:
        if c.instance_id == decision.prefill and c.predicted_ttft_s is not None:
            prefill = c
            break
    if prefill is None:
        return None
    decoder = decision.decode or decision.prefill  # mixed: the same worker decodes
    for c in decision.candidates:
        if c.instance_id == decoder and c.predicted_tbt_s is not None:
            decode = c
            break
    return prefill, decode


class _NoRatios:
    """Where the ratios of predictions made by a replaced model go: nowhere."""

    def add(self, key: str, predicted: float, actual: float) -> None:
        return None


class OutcomeLearner:
    """The pending predictions of admitted requests (at most `max_pending`, the oldest forgotten
    first: observations that never came) and the learning from their outcomes.
    `refit_queue_fraction`: legs whose predicted queue is at most this fraction of the observed leg
    are also recorded as "prefill" errors (a nearly idle instance: the leg is its own compute)."""

    __slots__ = ("max_pending", "pending", "predictors", "refit_queue_fraction")

    def __init__(self, predictors: Predictors, *, refit_queue_fraction: float, max_pending: int) -> None:
        self.predictors = predictors
        self.refit_queue_fraction = refit_queue_fraction
        self.max_pending = max(1, max_pending)
        self.pending: OrderedDict[str, _Pending] = OrderedDict()

    def remember(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        """Keep what was predicted for an admitted, disaggregated or mixed, placed request."""
        if decision.prefill is None or decision.predicted_ttft_s is None:
            return
        chosen = _chosen_candidates(decision)
        if chosen is None:
            return
        prefill, decode = chosen
        for instance in cluster.instances:
            if instance.id == decision.prefill:
                break
        else:
            return
        pred = self.predictors
        detail = prefill.detail
        queue_s, transfer_s, prefill_s = detail["queue_s"], detail["transfer_s"], detail["prefill_s"]
        features, head_elapsed = queue_features(instance.prefill_queue)
        ttft, tbt = decision.predicted_ttft_s, decision.predicted_tbt_s
        leg = queue_s + transfer_s + prefill_s
        judged_tbt = None if decode is None else decode.detail.get("admission_tbt_s", decode.predicted_tbt_s)
        self.pending[request.request_id] = _Pending(
            prefill=decision.prefill,
            decode=decision.decode,
            cached_tokens=int(detail["cached_tokens"]),
            queue_s=queue_s,
            transfer_s=transfer_s,
            prefill_s=prefill_s,
            ttft_s=ttft,
            tbt_s=tbt,
            queue_features=features,
            head_elapsed_s=head_elapsed,
            handoff_s=detail["handoff_s"],
            first_tbt_s=0.0 if tbt is None else tbt,
            bounds=(  # only ever recorded with the errors: not computed when they are not kept
                pred.bound("ttft", ttft, 0.9),
                pred.bound("queue_and_prefill", leg, 0.9),
                pred.bound("tbt_at_decision", tbt, 0.9) if tbt is not None else 0.0,
            )
            if pred.tracks_errors
            else _NO_BOUNDS,
            judged_tbt_s=judged_tbt,
            generation=pred.generation,
            sharing=(float(instance.resident_kv_tokens), float(len(instance.decodes))) if decision.decode is None else None,
        )
        while len(self.pending) > self.max_pending:  # observations that never came: forget them
            self.pending.popitem(last=False)

    def learn_leg(self, leg: PrefillLeg) -> None:
        """Teach the prefill model a request's leg as soon as it is over (see PrefillLegObserver: a
        disaggregated prefill answered, a mixed worker's first token streamed); its Observation
        later teaches the rest, not the leg again."""
        p = self.pending.get(leg.request_id)
        if p is None or p.leg_learned or leg.prefill != p.prefill or not leg.queue_and_prefill_s > 0:
            return
        p.leg_learned = True
        self._learn_leg(p, leg.queue_and_prefill_s, leg.cached_tokens, leg.prompt_tokens)

    def _learn_leg(self, p: _Pending, leg: float, cached_tokens: int | None, prompt_tokens: int) -> None:
        pred = self.predictors
        ratios = pred.ratios if p.generation[0] == pred.ttft_generation else _NoRatios()
        # the leg's and the prefill's errors and ratios feed only the exported error figures
        # (their bounds are read where errors are tracked): kept only there
        errors = pred.tracks_errors
        if errors:
            predicted_leg = p.queue_s + p.transfer_s + p.prefill_s
            pred.record_error("queue_and_prefill", p.prefill, predicted_leg, p.bounds[1], leg)
            ratios.add("queue_and_prefill", predicted_leg, leg)
        cached = p.cached_tokens if cached_tokens is None else cached_tokens
        cached = max(0, min(cached, prompt_tokens - 1))
        own = prefill_features(prompt_tokens - cached, cached)
        if errors and p.queue_s <= self.refit_queue_fraction * leg and leg > p.transfer_s:
            own_s = leg - p.transfer_s - p.queue_s  # nearly idle instance: the leg is its own compute
            pred.record_error("prefill", p.prefill, p.prefill_s, pred.bound("prefill", p.prefill_s, 0.9), own_s)
            ratios.add("prefill", p.prefill_s, own_s)
        # every leg teaches the prefill model: behind an FCFS queue it is the queue's prefills
        # (the head's remainder) plus its own, linear in the same coefficients
        qf = p.queue_features
        features = (qf[0] + own[0], qf[1] + own[1], qf[2] + own[2])
        if p.sharing is None:
            pred.observe_leg(features, leg + p.head_elapsed_s - p.transfer_s)
        else:
            pred.observe_mixed_leg(mixed_leg_features(features, *p.sharing), leg + p.head_elapsed_s - p.transfer_s)

    def learn(self, observation: Observation) -> None:
        """Compare the request's outcome with what was predicted for it, and teach the predictors."""
        obs = observation
        p = self.pending.pop(obs.request_id, None)
        if p is None or not obs.ok:
            return
        pred = self.predictors
        ttft_hi, _, tbt_hi = p.bounds
        ttft_ratios = pred.ratios if p.generation[0] == pred.ttft_generation else _NoRatios()
        tbt_ratios = pred.ratios if p.generation[1] == pred.tbt_generation else _NoRatios()
        # the decision-time TBT's errors and ratios feed only the exported error figures
        errors = pred.tracks_errors
        leg = obs.queue_and_prefill_s
        if leg is None and p.decode is None and obs.ttft_s is not None:
            # a mixed worker reports no prefill leg: its first token ends the prefill (queue, the
            # prompt's chunks and the step that samples it), so its TTFT teaches the prefill model
            leg = obs.ttft_s
        if leg is not None and leg > 0 and obs.prefill == p.prefill:
            if not p.leg_learned:
                self._learn_leg(p, leg, obs.cached_tokens, obs.prompt_tokens)
            if obs.ttft_s is not None and obs.ttft_s > leg and p.decode is not None:
                pred.observe_decode_leg(obs.prompt_tokens, p.first_tbt_s, obs.ttft_s - leg)
        if obs.ttft_s is not None and obs.ttft_s > 0:
            pred.record_error("ttft", p.prefill, p.ttft_s, ttft_hi, obs.ttft_s)
            ttft_ratios.add("ttft", p.ttft_s, obs.ttft_s)
        decoder = obs.decode or (obs.prefill if p.decode is None else None)  # mixed: same worker
        if obs.token_intervals_s and decoder is not None:
            mean = sum(obs.token_intervals_s) / len(obs.token_intervals_s)
            if errors and p.tbt_s is not None:
                pred.record_error("tbt_at_decision", decoder, p.tbt_s, tbt_hi, mean)
                tbt_ratios.add("tbt_at_decision", p.tbt_s, mean)
            if p.judged_tbt_s is not None:
                tbt_ratios.add("tbt_judged", p.judged_tbt_s, mean)
            kv = obs.decode_resident_kv_tokens + obs.prompt_tokens + obs.output_tokens // 2
            pred.observe_tbt(obs.decode_batch + 1, kv, mean, decoder)
