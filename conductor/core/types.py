"""Value objects the scheduling decision is made from and made of.

A policy is a pure function of (RequestView, ClusterSnapshot) -> Decision. Everything here is a
frozen dataclass with no I/O, so the gateway and the trace simulator hand policies exactly the same
kind of objects. Times are seconds, sizes are tokens unless a name says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from conductor.core.fast_init import fast_init

_EMPTY: Mapping[str, float] = MappingProxyType({})


class Role(StrEnum):
    """What an instance does in the P/D split."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # a non-disaggregated worker: prefill and decode on one engine


class Tier(StrEnum):
    """Where a cached KV block lives, fastest first."""

    DEVICE = "device"  # the instance's GPU memory (vLLM reports medium "GPU")
    HOST = "host"  # the instance's CPU memory (offloaded)
    STORE = "store"  # the pooled Mooncake Store, reachable from every instance


@fast_init
@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives a request must meet; None means no bound."""

    ttft_s: float | None = None  # time to first token
    tbt_s: float | None = None  # time between tokens (mean over the stream)


@fast_init
@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """How many leading tokens of one request an instance already holds, and where."""

    tokens: int  # leading tokens cached (a whole number of blocks)
    tier: Tier = Tier.DEVICE


@fast_init
@dataclass(frozen=True, slots=True)
class RequestView:
    """What a policy may know about a request: sizes and block keys, never prompt text."""

    request_id: str
    seq: int  # gateway-assigned, increasing: lets stateless policies rotate (round robin)
    model: str
    prompt_tokens: int  # exact when tokenized at the gateway, else an estimate
    max_tokens: int  # output tokens the request may produce (its max_tokens or the default)
    block_size: int = 16
    block_keys: tuple[int, ...] = ()  # chained keys of the prompt's full blocks
    cached: Mapping[str, CachedPrefix] = field(default_factory=dict)  # instance id -> its prefix
    store_cached_tokens: int = 0  # leading tokens present in the pooled store (Mooncake Store)
    slo: Slo = Slo()
    stream: bool = False
    # Where a prefill could pull a cached prefix from, and how many leading tokens: instance id ->
    # tokens. The gateway lists only pulls it can carry out (a NIXL decode's readback of the last
    # turn, conductor/routing/readback.py); empty when the cluster has no pull mechanism. None: every
    # instance in `cached` is a source (a cluster whose instances pull from each other, as the
    # simulator's peer-pull mode models).
    pull_sources: Mapping[str, int] | None = None
    # The sources among `pull_sources` whose KV becomes readable only after a small staging request
    # has gone through their own FCFS prefill queue (a NIXL prefill-to-prefill pull: the holder is
    # asked for the prefix's block ids first, conductor/routing/peer_pull.py). A policy adds that queue's
    # predicted wait to a pull from them; a decode's readback or the store needs no staging.
    queued_pull_sources: frozenset[str] = frozenset()
    # True: those staging requests jump the holder's waiting queue (vLLM priority scheduling), so
    # they wait only for the prefill running there
    staging_jumps_queue: bool = False
    # the gateway's priority class (`priority.classes`) and tenant (`auth.tenants`) of the request,
    # None where none is configured; its class's SLO is already in `slo`
    priority: str | None = None
    tenant: str | None = None
    # the request's session (conversation, agent run) as a bounded hash of its session header,
    # `prompt_cache_key` or `user` (conductor/routing/sessions.py), never the client's string;
    # None when it names none. A policy may keep a session's turns on one instance (kvcache_aware)
    session: int | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """One prefill dispatched to an instance and not finished yet."""

    new_tokens: int  # tokens the instance must compute
    cached_tokens: int  # tokens it reuses from its cache
    # for the head of the FCFS queue (the one running, the only entry whose elapsed time a queue
    # estimate may subtract): time since it started, i.e. since its dispatch or since the entry
    # before it finished, whichever is later; the gateway and the simulator fill it so
    elapsed_s: float
    # its end is seen when its prefill is over (a streamed first token, a NIXL prefill's answer);
    # False: it leaves the queue only with the whole answer (a non-streamed request on a mixed
    # worker, another replica's entry), so its elapsed time says nothing about its prefill's
    end_seen: bool = True


@fast_init
@dataclass(frozen=True, slots=True)
class ActiveDecode:
    """One decode stream running on an instance."""

    context_tokens: int  # prompt plus tokens generated so far: the KV it keeps resident
    remaining_tokens: int  # tokens still to generate, at most (max_tokens - generated)
    # False while the request is routed here but still in prefill or KV transfer (listed from
    # dispatch): "load now" (plain early rejection) leaves these out, forecasts count them in
    decoding: bool = True
    # the stream's own pace as the gateway saw it (a streamed answer's tokens as they came): tokens
    # generated and when the first came, on the snapshot's clock (ClusterSnapshot.now); None where
    # it is not seen (a non-streamed answer, another replica's stream). A stream that ran faster than
    # its TBT SLO has slack to absorb a pause (policies.estimate.stall_fits)
    generated: int = 0
    first_token_at: float | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class InstanceView:
    """What the gateway knows about one worker at decision time."""

    id: str  # stable name, unique in the cluster
    role: Role
    url: str = ""
    healthy: bool = True
    prefill_queue: tuple[QueuedPrefill, ...] = ()  # prefills dispatched here and not finished
    decodes: tuple[ActiveDecode, ...] = ()  # decode streams in flight here
    kv_capacity_tokens: int | None = None  # None when unknown
    kv_usage: float | None = None  # 0..1 from the worker's own metrics, when scraped
    waiting_requests: int | None = None  # from the worker's own metrics, when scraped

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(q.new_tokens for q in self.prefill_queue)

    @property
    def resident_kv_tokens(self) -> int:
        return sum(d.context_tokens for d in self.decodes)


@fast_init
@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The whole cluster as seen by one gateway at one instant."""

    now: float  # monotonic seconds; policies compare it with nothing but durations
    instances: tuple[InstanceView, ...]

    def by_role(self, *roles: Role, healthy_only: bool = True) -> tuple[InstanceView, ...]:
        # list comprehensions: every policy calls this two or three times a decision, and a
        # generator expression into tuple() costs about twice as much over a few dozen instances
        if healthy_only:
            return tuple([i for i in self.instances if i.role in roles and i.healthy])
        return tuple([i for i in self.instances if i.role in roles])


@fast_init
@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One instance as the policy weighed it; logged with every decision."""

    instance_id: str
    role: Role
    score: float  # the policy's own figure of merit; lower is better
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    detail: Mapping[str, float] = field(default_factory=lambda: _EMPTY)  # named components (transfer_s, queue_s, prefill_s, ...)


@fast_init
@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request is refused before anything is forwarded (HTTP 429)."""

    reason: str  # "ttft_slo", "tbt_slo" or "capacity"
    message: str  # human-readable; says which bound and by how much
    predicted_s: float | None = None
    slo_s: float | None = None
    retry_after_s: float = 1.0
    # False when retrying cannot help: the request alone misses the SLO even on an idle cluster
    retryable: bool = True


@fast_init
@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes, or why it does not go anywhere.

    For a disaggregated cluster both `prefill` and `decode` are set; for mixed workers `prefill`
    names the one worker that serves the whole request and `decode` is None. Both set to the same
    decode instance: that decode computes the prompt itself (policies/local_prefill.py).
    """

    request_id: str
    policy: str
    prefill: str | None = None
    decode: str | None = None
    rejection: Rejection | None = None
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    pull_from: str | None = None  # instance id or "store" the prefill pulls a cached prefix from
    pull_tokens: int = 0  # tokens of that prefix it pulls instead of recomputing
    candidates: tuple[CandidateScore, ...] = ()
    # instances the policy weighed but left out of `candidates` (a policy may list only the best
    # few of a large pool, the chosen ones always among them): 0 when every one is listed
    unlisted_candidates: int = 0

    @property
    def rejected(self) -> bool:
        return self.rejection is not None

    @property
    def prefilled_on_decode(self) -> bool:
        """The decode instance computes the prompt itself: no prefill leg, no KV transfer."""
        return self.decode is not None and self.prefill == self.decode


@fast_init
@dataclass(frozen=True, slots=True)
class Observation:
    """What the gateway saw when a request it routed finished (or failed)."""

    request_id: str
    prefill: str | None
    decode: str | None
    prompt_tokens: int
    cached_tokens: int | None  # as the worker reported (usage.prompt_tokens_details.cached_tokens)
    predicted_cached_tokens: int  # what the index predicted for the chosen prefill instance
    queue_and_prefill_s: float | None  # prefill leg: dispatch to first token / prefill response
    ttft_s: float | None  # at the gateway: arrival to first token sent to the client
    token_intervals_s: tuple[float, ...] = ()  # decode: gaps between streamed tokens
    output_tokens: int = 0
    decode_batch: int = 0  # other decode streams on that instance when this one joined (not counting it)
    decode_resident_kv_tokens: int = 0  # their resident KV tokens then
    ok: bool = True
    # usage.prompt_tokens as the worker reported it (None: not reported); differing from
    # prompt_tokens means the gateway tokenizes unlike the workers (kv hash agreement diagnosis)
    reported_prompt_tokens: int | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class PrefillLeg:
    """A request's prefill leg, reported as soon as it is over, before the request's decode (and so
    its Observation) is: a cold or drifted prefill model learns from it a decode's length sooner,
    while the queues it misjudges are still short. Two kinds of leg:

    * disaggregated (NIXL): the prefill instance answered; `queue_and_prefill_s` is dispatch to
      that answer, as the Observation's `queue_and_prefill_s` repeats it.
    * a mixed worker's streamed answer (no prefill leg of its own: its first token ends the
      prefill): `queue_and_prefill_s` is the request's arrival to that first token, as the
      Observation's `ttft_s` repeats it, and `cached_tokens` is None (the worker reports them with
      its last chunk). A non-streamed answer shows no first token: none is reported."""

    request_id: str
    prefill: str  # the instance that answered the leg (a mixed worker: the worker itself)
    prompt_tokens: int
    cached_tokens: int | None  # as the prefill worker reported it (None: not reported)
    queue_and_prefill_s: float  # see above: the Observation's queue_and_prefill_s, or its ttft_s (mixed)


@runtime_checkable
class PrefillLegObserver(Protocol):
    """Optional beside Policy: a policy that has `observe_prefill_leg` is given each PrefillLeg of
    a request it placed, where the protocol answers the prefill before the decode starts (vLLM
    NIXL), and at the first token of a mixed worker's streamed answer; the request's Observation
    follows, with the same leg in `queue_and_prefill_s` (mixed: in `ttft_s`), and a policy that
    learned the leg early must not learn it again from there."""

    def observe_prefill_leg(self, leg: PrefillLeg) -> None: ...


@runtime_checkable
class Policy(Protocol):
    """A scheduling policy, called by the gateway and the simulator alike in this order:

    1. `decide(request, cluster)`: a function of its arguments and of the policy's state as it is;
       it changes nothing (no I/O, no state): calling it twice gives the same decision.
    2. `on_decided(request, cluster, decision)`: right after, with the same arguments and the
       decision `decide` returned. The one method where a policy remembers what it decided
       (e.g. predictions to learn from later, a count of rejections in a row).
    3. `observe(observation)`: when an admitted request finishes or fails; may update fitted state.

    Before 3, a policy that is also a PrefillLegObserver is given the request's prefill leg (NIXL;
    a mixed worker's first token of a stream).
    """

    name: str

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision: ...

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None: ...

    def observe(self, observation: Observation) -> None: ...
