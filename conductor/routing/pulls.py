"""Prefix pulls, from offer to bookkeeping: the one place that knows a prefill can read a prefix it
lacks from another instance instead of computing it.

Two sources, both vLLM NIXL with `bidirectional_kv_xfer`:
- a decode's readback (conductor/routing/readback.py): the KV a decode keeps pinned after a turn,
  filed here when its answer says where, offered to the next turn's decision, taken once;
- a peer prefill holding the prefix (conductor/routing/peer_pull.py), which must first stage it.

`PullPlanner` is the life of a pull for one request: `offer` (what the policy may choose from),
`plan` (what the chosen decision really pulls, at dispatch), `prepare` (the readback's params, or
the staging, on the outgoing request), `fall_back` (the prefill could not read it: compute it),
and `keep` (file a decode's pinned KV for the next turn).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from adapters.pd.base import Outgoing, PDProtocol, PrefixStager
from conductor.config.derived import peer_pull_possible
from conductor.config.settings import Settings
from conductor.core.errors import ConfigError, UpstreamError
from conductor.core.fast_init import fast_init
from conductor.core.types import Decision, RequestView
from conductor.fleet.instances import InstanceRegistry
from conductor.kv.analysis import PromptAnalysis
from conductor.ops.metrics import GatewayMetrics
from conductor.routing.peer_pull import peer_sources, pull_params
from conductor.routing.readback import Offer, ReadbackTable, parse_decode_params, pull_sources, pull_tokens_for

log = logging.getLogger(__name__)


@fast_init
@dataclass(frozen=True, slots=True)
class PullOffer:
    """The pulls offered to the policy for one decision (RequestView.pull_sources and friends)."""

    readback: Offer | None = None  # the decode readback offered (taken only if the decision pulls it)
    sources: Mapping[str, int] = field(default_factory=dict)  # instance -> tokens the prefill would hold
    queued: frozenset[str] = frozenset()  # sources that need a staging request first (peer prefills)
    jumps_queue: bool = False  # staging runs at a priority ahead of the clients' requests


NO_PULL_OFFER = PullOffer()


@fast_init
@dataclass(frozen=True, slots=True)
class PullPlan:
    """What a dispatched decision pulls: nothing, a readback taken now, or a prefix to stage first."""

    local_cached: int  # leading tokens the prefill instance holds itself
    predicted_cached: int  # what it holds once the pull is done (local_cached without a pull)
    params: Mapping[str, Any] | None = None  # a readback's kv_transfer_params for the prefill leg
    stage: tuple[str, int] | None = None  # a peer pull: (holder, prefix tokens) to stage first

    @property
    def pulls(self) -> bool:
        """Whether the outgoing request changes for it (`PullPlanner.prepare` has work to do)."""
        return self.params is not None or self.stage is not None

    @property
    def source_kind(self) -> str:
        """The metric its outcome is counted on."""
        return "peer_pull" if self.stage is not None else "readback"


class PullPlanner:
    """The decode readback table, peer pulls and staging for one gateway (module doc)."""

    def __init__(self, settings: Settings, registry: InstanceRegistry, protocol: PDProtocol, metrics: GatewayMetrics) -> None:
        self._settings = settings
        self._registry = registry
        self._metrics = metrics
        self._stager = protocol if isinstance(protocol, PrefixStager) else None
        self._protocol = protocol
        pd = settings.pd
        # decode readbacks (NIXL bidirectional KV transfer): only where block keys say which prefix matches
        self.readback = (
            ReadbackTable(ttl_s=pd.readback_ttl_s, max_handles=pd.readback_max_handles)
            if protocol.name == "nixl" and pd.readback == "auto" and settings.kv.enabled
            else None
        )
        # prefill-to-prefill pulls: possible where the settings allow them, active from the start
        # ("on") or once a decode has shown the cluster runs bidirectional NIXL
        self.peer_pull = peer_pull_possible(settings)
        if pd.peer_pull == "on" and not self.peer_pull:
            raise ConfigError(
                "pd.peer_pull 'on' needs the gateway's token ids to be the workers' own: a model "
                "tokenizer for kv.tokenizer, or kv.forward_token_ids true"
            )

    def peer_pull_active(self) -> bool:
        """Whether prefill-to-prefill pulls are offered to the policy now (settings.pd.peer_pull)."""
        if not self.peer_pull:
            return False
        return self._settings.pd.peer_pull == "on" or (self.readback is not None and self.readback.recorded > 0)

    # ---- deciding ---------------------------------------------------------------------------
    def offer(self, analysis: PromptAnalysis, exclude: frozenset[str]) -> PullOffer:
        """The pulls a decision for this prompt may choose, leaving out the instances in `exclude`."""
        states = self._registry.states
        readback = None
        if self.readback is not None and analysis.block_keys:
            readback = self.readback.offer(
                analysis.block_keys, lambda name: name not in exclude and name in states and states[name].healthy
            )
        block_size = self._settings.block_size
        sources = pull_sources(readback, analysis.prompt_tokens, block_size)
        if not (analysis.cached and analysis.token_ids is not None and self.peer_pull_active()):
            return PullOffer(readback, sources) if readback is not None or sources else NO_PULL_OFFER
        pd = self._settings.pd
        peers = peer_sources(
            analysis,
            states,
            lambda name: name not in exclude and self._protocol.ready(states[name].target),
            block_size,
            pd.pull_min_tokens,
        )
        if not peers:
            return PullOffer(readback, sources)
        return PullOffer(readback, {**peers, **sources}, frozenset(peers), pd.peer_pull_priority is not None)

    # ---- dispatching ------------------------------------------------------------------------
    def plan(
        self, decision: Decision, view: RequestView, offer: PullOffer, local_cached: int, *, may_pull: bool = True
    ) -> PullPlan:
        """What the chosen decision pulls. A readback is taken from the table here (a handle serves
        once); a pull vLLM would skip (under pd.pull_min_tokens gained) leaves the handle for another
        turn, and a peer pull whose lease could run out before the prefill reads it is skipped.
        `may_pull`: the exchange can carry a pull (a batch's per-prompt legs cannot); a decode that
        prefills the request itself pulls nothing either."""
        source = decision.pull_from
        min_gain = self._settings.pd.pull_min_tokens  # vLLM pulls nothing smaller (kv_recompute_threshold)
        readback = offer.readback
        if not may_pull or source is None or decision.prefilled_on_decode:
            pass
        elif readback is not None and self.readback is not None and source == readback.handle.instance:
            size = view.block_size
            tokens = pull_tokens_for(readback, view.prompt_tokens, size)
            if tokens - local_cached >= min_gain:
                handle = self.readback.take(readback)
                if handle is None:
                    self._metrics.readback.labels("lost").inc()  # another request took it first
                else:
                    self._metrics.readback.labels("pulled").inc()
                    return PullPlan(local_cached, max(local_cached, tokens), params=handle.params(tokens // size, size))
        elif source in offer.queued:
            tokens = offer.sources.get(source, 0)
            # the holder keeps a staged prefix for its lease only: the prefill must read it before then
            late = (decision.predicted_ttft_s or 0.0) > self._settings.pd.peer_pull_lease_s / 2
            if tokens - local_cached < min_gain or late:
                self._metrics.peer_pull.labels("skipped").inc()
            else:
                return PullPlan(local_cached, tokens, stage=(source, tokens))
        return PullPlan(local_cached, local_cached)

    async def prepare(self, plan: PullPlan, out: Outgoing, analysis: PromptAnalysis) -> tuple[Outgoing, int]:
        """The outgoing request carrying the plan's pull, and the leading tokens the prefill will
        then hold: a readback's params as they are; a peer's prefix staged first, within half its
        lease (a staging that fails or is late leaves the prefill to compute the prefix)."""
        if plan.params is not None:
            return replace(out, pull=plan.params), plan.predicted_cached
        assert plan.stage is not None  # asked only of a plan that pulls (`PullPlan.pulls`)
        holder, tokens = plan.stage
        wait_s = self._settings.pd.peer_pull_lease_s / 2
        try:
            async with asyncio.timeout(wait_s):
                staged = await self._stage(holder, out, analysis, tokens)
        except TimeoutError:
            self._metrics.peer_pull.labels("stage_failed").inc()
            log.warning(
                "request %s: staging on %s took over %.1f s; the prefill computes the prefix", out.request_id, holder, wait_s
            )
            staged = None
        if staged is None:
            return out, plan.local_cached
        return replace(out, pull=staged), plan.predicted_cached

    async def _stage(self, holder: str, out: Outgoing, analysis: PromptAnalysis, tokens: int) -> dict[str, Any] | None:
        """Stage the prompt's first `tokens` tokens on `holder` (conductor/routing/peer_pull.py); the
        pull's params, or None when staging failed (counted, logged)."""
        ids = analysis.token_ids
        state = self._registry.states.get(holder)
        if ids is None or self._stager is None or state is None or len(ids) <= tokens:
            self._metrics.peer_pull.labels("stage_failed").inc()
            return None
        stage_id = f"{out.request_id}-stage"
        # the holder computes one token for it and pins the prefix: other decisions see that load
        self._registry.add_prefill(holder, stage_id, 1, tokens)
        try:
            answer, elapsed = await self._stager.stage_prefix(
                state.target, out, ids[: tokens + 1], self._settings.pd.peer_pull_priority
            )
        except UpstreamError as exc:
            self._metrics.peer_pull.labels("stage_failed").inc()
            log.warning(
                "request %s: staging %d tokens on %s failed (%s); the prefill computes them",
                out.request_id,
                tokens,
                holder,
                exc.message,
            )
            return None
        finally:
            self._registry.end_prefill(holder, stage_id)
        params = pull_params(answer, tokens, self._settings.block_size)
        if params is None:
            self._metrics.peer_pull.labels("stage_failed").inc()
            log.warning(
                "request %s: %s answered the staging request without usable kv_transfer_params (is it a "
                "NIXL prefill?); the prefill computes the prefix",
                out.request_id,
                holder,
            )
            return None
        self._metrics.peer_pull.labels("staged").inc()
        self._metrics.peer_pull_stage.observe(elapsed)
        return params

    # ---- when it fails, when it ends --------------------------------------------------------
    @staticmethod
    def pull_failed(out: Outgoing, exc: UpstreamError, prefill: str) -> bool:
        """A prefill leg that carried a pull answered 5xx: the pull may be what failed."""
        return out.pull is not None and exc.instance == prefill and (exc.upstream_status or 0) >= 500

    def fall_back(self, plan: PullPlan, out: Outgoing, exc: UpstreamError, source: str | None) -> Outgoing:
        """The prefill could not read the prefix (a NIXL handshake or transfer failure fails the
        request there, vLLM's default kv_load_failure_policy): not the prefill's fault, and nothing
        was computed, so the same prefill computes the prefix itself; the request without the pull."""
        metric = self._metrics.peer_pull if plan.source_kind == "peer_pull" else self._metrics.readback
        metric.labels("failed").inc()
        log.warning(
            "request %s: %s could not pull the prefix from %s (%s); computing it there instead",
            out.request_id,
            exc.instance,
            source,
            exc,
        )
        return replace(out, pull=None)

    def keep(self, decode: str, prompt_keys: Sequence[int], params: Any) -> None:
        """File a bidirectional decode's pinned KV (`Exchange.decode_kv_params`) for the next turn."""
        if self.readback is None or not prompt_keys or params is None:
            return
        handle = parse_decode_params(decode, params, len(prompt_keys), self.readback.now())
        if handle is None:
            self._metrics.readback.labels("unusable").inc()
            return
        self.readback.record(prompt_keys, handle)
        self._metrics.readback.labels("recorded").inc()
