"""What cluster the simulator models: sizes, capacities, SLOs, noise and speed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from conductor.core.types import Slo
from traces.sim.classes import SimClasses
from traces.sim.truth import TruthModel, fit_truth

# Which KV transfer mechanisms the cluster has for prefix pulls (the P -> D handoff always exists):
# "peer" pulls from another prefill instance's memory (Mooncake Transfer Engine / NIXL between
# instances), "store" from the pooled Mooncake Store (needs store_capacity_tokens > 0), "both", "none".
# "staged" and "staged-fcfs" are peer pulls as the gateway carries them out over stock vLLM NIXL
# (conductor/routing/peer_pull.py): the holder first serves a one-token staging request that pins the
# prefix, which waits for the prefill running there ("staged": vLLM priority scheduling, the
# staging request jumps the queue) or for the holder's whole queue ("staged-fcfs").
PULL_MODES: Final = ("none", "peer", "store", "both", "staged", "staged-fcfs")
# How a decode instance hands out KV space (traces/sim/cluster.py, DecodeInstance): "preempt" as
# vLLM does (join when the context fits; preempt the last joined when the cache fills; recompute on
# rejoin), "reserve" (join only when prompt and all output fit; never preempt).
DECODE_KV_MODES: Final = ("preempt", "reserve")
# How the prompt's KV goes from prefill to decode: "whole" after the prefill (vLLM's NIXL and
# Mooncake connectors), "layerwise" streamed as each layer is computed (Mooncake's own engine).
KV_HANDOFF_MODES: Final = ("whole", "layerwise")
DEFAULT_KV_LAYERS: Final = 36  # Qwen3-8B, the bundled profile's model


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated P/D cluster and how the trace is driven through it."""

    n_prefill: int
    n_decode: int
    truth: TruthModel = field(default_factory=fit_truth)
    prefill_cache_tokens: int = 3_000_000  # each prefill instance's local prefix cache (LRU over blocks)
    store_capacity_tokens: int = 0  # Mooncake Store pool shared by all instances; 0 = no store
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=30.0, tbt_s=0.1))
    speedup: float = 1.0  # arrivals are replayed at timestamp / speedup
    noise: float = 0.05  # sigma of the lognormal noise on every prefill and decode step (0 = exact)
    seed: int = 0
    model: str = "sim-model"
    snapshot_refresh_s: float = 0.1  # views handed to policies are rebuilt at least this often
    max_prefill_queue: int = 256  # prefills queued on one instance; past it: rejected ("queue_full")
    # The gateway lists a request under its decode instance from dispatch (conductor/server/endpoint.py calls
    # add_decode before the prefill finishes); False lists only streams already decoding.
    routed_in_decode_view: bool = True
    observe: bool = True  # feed simulated outcomes back to policy.observe()
    # hand the trace's sessions (TraceRequest.session) to the policy as RequestView.session, as the
    # gateway does a request's session header; False: every request session-less
    sessions: bool = True
    # what the policy's KV index sees of the prefill caches: each finished prefill's blocks this many
    # seconds after it (0: at once, an exact index; a live one lags by its KV events), evictions as
    # late; None: KV awareness off (the gateway's `kv.enabled: false`): no block keys, so no index of
    # the caches or the store and nothing for the policy's in-flight table. Only the policy's view:
    # the instances reuse what they hold either way.
    index_delay_s: float | None = 0.0
    # reject at the decode stage when joining would break the TBT SLO (the baseline's second check
    # in arXiv 7.1; admitted streams then meet TBT in every admission mode, and prefill is wasted)
    decode_guard: bool = False
    # prefix pulls the cluster can do (PULL_MODES); a decision asking for another is refused. The
    # runner also hands it to policies that take an `allow_pull` option (kvcache_aware), so they
    # plan only pulls that can happen. "both": any pull a policy asks for, as before this option.
    pull: str = "both"
    decode_kv: str = "preempt"  # DECODE_KV_MODES
    kv_handoff: str = "whole"  # KV_HANDOFF_MODES
    kv_layers: int = DEFAULT_KV_LAYERS  # layers the KV is streamed by (kv_handoff "layerwise"): Qwen3-8B 36, LLaMA3-70B 80
    # mixed (non-disaggregated) workers instead of P/D: `n_decode` of them, `n_prefill` 0. Each is a
    # decode instance that prefills every request it is given itself (policies/local_prefill.py's
    # path: FCFS, its batch stalls while a prefill runs, as the emulator's and vLLM's steps carry the
    # decodes along a prefill) with a prefix cache of `prefill_cache_tokens`; the policy sees
    # Role.MIXED instances and decides `prefill` = the worker, `decode` None
    mixed: bool = False
    # the gateway's waiting room (its `hold` settings, conductor/config/groups.py HoldSettings): a job
    # refused for its TBT only waits for streams to end, at most this many at once (0: none waits)
    hold_max: int = 256
    hold_max_wait_s: float = 10.0
    # priority classes, tenants and the in-flight limit, as the gateway runs them (traces/sim/classes.py);
    # None: every request of one class with `slo`, no tenants, no limit
    classes: SimClasses | None = None

    def __post_init__(self) -> None:
        if self.mixed:
            if self.n_prefill != 0 or self.n_decode < 1:
                raise ValueError("a mixed cluster has n_prefill 0 and at least one worker (n_decode)")
        elif self.n_prefill < 1 or self.n_decode < 1:
            raise ValueError("a P/D cluster needs at least one prefill and one decode instance")
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if self.prefill_cache_tokens < 0 or self.store_capacity_tokens < 0:
            raise ValueError("cache capacities must be >= 0")
        if self.pull not in PULL_MODES:
            raise ValueError(f"pull must be one of {', '.join(PULL_MODES)}, not {self.pull!r}")
        if self.kv_handoff not in KV_HANDOFF_MODES:
            raise ValueError(f"kv_handoff must be one of {', '.join(KV_HANDOFF_MODES)}, not {self.kv_handoff!r}")
        if self.kv_layers < 1:
            raise ValueError("kv_layers must be >= 1")
        if self.index_delay_s is not None and not self.index_delay_s >= 0:
            raise ValueError(f"index_delay_s must be >= 0 or None, not {self.index_delay_s!r}")
        if self.decode_kv not in DECODE_KV_MODES:
            raise ValueError(f"decode_kv must be one of {', '.join(DECODE_KV_MODES)}, not {self.decode_kv!r}")

    @property
    def pull_from_peer(self) -> bool:
        return self.pull in ("peer", "both", "staged", "staged-fcfs")

    @property
    def staging(self) -> str | None:
        """How a peer pull's staging request waits on the holder: "priority", "fcfs", or None (none needed)."""
        return {"staged": "priority", "staged-fcfs": "fcfs"}.get(self.pull)

    @property
    def pull_links(self) -> str:
        """The links a policy's `allow_pull` may use (policies.kvcache_aware.pull_links)."""
        return "peer" if self.staging else self.pull

    @property
    def pull_from_store(self) -> bool:
        return self.pull in ("store", "both")

    def prefill_ids(self) -> tuple[str, ...]:
        return tuple(f"prefill-{i}" for i in range(self.n_prefill))

    def decode_ids(self) -> tuple[str, ...]:
        return tuple(f"{'mixed' if self.mixed else 'decode'}-{i}" for i in range(self.n_decode))
