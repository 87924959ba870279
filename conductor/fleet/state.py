"""One instance's mutable bookkeeping (`InstanceState`): its health, the work this gateway queued
and runs there, where it came from; and the frozen `InstanceView` of it a policy decides from.
The registry of them all: conductor/fleet/instances.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from adapters.pd.base import Target
from conductor.config.settings import InstanceSpec
from conductor.core.models import AdapterCard
from conductor.core.types import ActiveDecode, InstanceView, QueuedPrefill
from conductor.fleet.health import InstanceHealth

RemoteEntry = tuple[tuple[QueuedPrefill, ...], tuple[ActiveDecode, ...]]
# where an instance came from: the settings' lists, the admin API, or DNS discovery
Origin = Literal["static", "admin", "dns"]


@dataclass(slots=True)
class InstanceState:
    """Mutable bookkeeping for one instance; the policy only ever sees frozen InstanceViews of it."""

    spec: InstanceSpec
    target: Target
    health: InstanceHealth
    # the base models it serves: its spec's `models` when the settings list them, else what its
    # /v1/models lists (read again each health.models_refresh_s: conductor/fleet/model_pools.py)
    models: tuple[str, ...] = ()
    # the LoRA adapters it lists, by served name (a request names one in its `model`)
    adapters: dict[str, AdapterCard] = field(default_factory=dict)
    # whether `models` is known (listed in the settings or by the worker): until then the
    # instance serves any model, as it would with one model behind the gateway
    models_known: bool = False
    models_due: float = 0.0  # time.monotonic() when its /v1/models is read again
    # model or adapter -> its context length, as the worker's /v1/models says (vLLM's max_model_len)
    context_lengths: dict[str, int] = field(default_factory=dict)
    # model or adapter -> the fields of its /v1/models card the gateway passes on (conductor/fleet/model_cards.py)
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    # request id -> work queued here, in dispatch order (FCFS); the frozen values are what views
    # hand out, so a snapshot costs a tuple() of them, not an object per in-flight request
    prefills: dict[str, QueuedPrefill] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)  # request id -> dispatch, or when it became the head
    last_prefill_end: float = float("-inf")  # time.monotonic() when one of this gateway's prefills here ended
    decodes: dict[str, ActiveDecode] = field(default_factory=dict)  # request id -> stream running here
    origin: Origin = "static"
    draining: bool = False  # out of rotation; removed once what runs here has ended
    drained_by: Origin | None = None  # who asked for the drain (DNS undoes only its own)

    def __post_init__(self) -> None:
        if self.spec.models is not None:
            self.models, self.models_known = self.spec.models, True

    @property
    def name(self) -> str:
        assert self.spec.name is not None
        return self.spec.name

    @property
    def healthy(self) -> bool:
        """May take requests: its probes answer, it is not ejected as an outlier nor draining."""
        return self.health.available and not self.draining

    def serves(self, model: str) -> bool:
        """Whether a request for `model` (a base model or an adapter) may go here."""
        return not self.models_known or model in self.models or model in self.adapters

    @property
    def inflight(self) -> int:
        """Requests of this gateway on the instance (a mixed one counts once)."""
        return len(self.prefills.keys() | self.decodes.keys())

    def view(
        self,
        now: float,
        remote: RemoteEntry | None = None,
        excluded: bool = False,
        remote_end: float | None = None,
        panic: bool = False,
    ) -> InstanceView:
        """`remote`: other replicas' work here; `remote_end`: when one of theirs last ended here;
        `panic`: its role is below the panic threshold, so it is routed to if it ever answered."""
        queue = tuple(self.prefills.values())
        if queue:  # only the head of an FCFS queue has run; its elapsed time is the one that matters
            head_id = next(iter(self.prefills))
            head = queue[0]
            queue = (QueuedPrefill(head.new_tokens, head.cached_tokens, now - self.started[head_id], head.end_seen), *queue[1:])
        decodes = tuple(self.decodes.values())
        if remote is not None:  # other gateway replicas' work on the same instance
            remote_queue, remote_decodes = remote
            if remote_queue and (not queue or remote_queue[0].elapsed_s > queue[0].elapsed_s):
                queue = remote_queue + queue  # theirs was dispatched first: it is the running head
            else:
                queue = queue + remote_queue
            decodes = decodes + remote_decodes
            # whoever's it is, the head has run at most since the last prefill here ended (see
            # adapters.load_share.PrefillEnds): each replica only knows its own ends
            last_end = max(self.last_prefill_end, remote_end if remote_end is not None else float("-inf"))
            if queue and now - last_end < queue[0].elapsed_s:
                head = queue[0]
                queue = (QueuedPrefill(head.new_tokens, head.cached_tokens, max(0.0, now - last_end), head.end_seen), *queue[1:])
        return InstanceView(
            id=self.name,
            role=self.spec.role,
            url=self.spec.url,
            healthy=(self.healthy or (panic and self.health.routable_in_panic and not self.draining)) and not excluded,
            prefill_queue=queue,
            decodes=decodes,
        )
