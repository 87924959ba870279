"""The `priority:` settings section: request classes, each with its own SLO, and which are shed first.

    priority:
      classes:
        interactive: {slo: {ttft_s: 1.0, tbt_s: 0.05}, rank: 0}
        batch: {slo: {ttft_s: 30.0}, rank: 2, sheddable: true}
      default: interactive      # the class of a request that names none
      header: x-priority        # where a request names its class (else a string `priority` in its body)
      sheddable_share: 0.5      # sheddable classes are admitted only while in flight < 0.5 x limits.max_inflight_requests
      guard_margin: 0.5         # a less urgent class is admitted only within 0.5 x the most urgent class's SLO
      trust_client_engine_priority: false   # a client's own integer `priority` (vLLM's) is dropped

A request's class (conductor/routing/priority.py): the header, else its body's `priority` when that is
a string, else its tenant's
`auth.tenants.<name>.priority` (conductor/config/groups.py), else `default`. A class's `slo` overrides
the request's model's SLO (`pools.<model>.slo`, else the gateway-wide `slo`) field by field, as a
pool's does the gateway's; the `x-slo-*` headers still override both (`Router.slo_for`).

`rank` orders the classes, 0 the most urgent. A `sheddable` class is refused (429 `priority_shed`)
while the gateway's requests in flight are at `share` (default `sheddable_share`) of
`limits.max_inflight_requests` or above (conductor/routing/shares.py says why that keeps room for the
others). Start-up errors: a `default` or a tenant's class that is not a class; `default` without
classes or classes without a `default`; a sheddable class ranked as urgent as, or more than, a class
that is not sheddable; a less urgent sheddable class with a larger share than a more urgent one (it
would be shed last). `guard_margin`: the policy's admission (kvcache_aware) judges a request of a class less urgent than the
most urgent by `min(its SLO, guard_margin x the most urgent class's SLO)`, so it takes only capacity
the urgent class does not need (policies/classes.py); its SLO as the client and the metrics see it is
its own. With no classes (the default) nothing of this applies: every request is as today.

The engine's own priority (vLLM's integer `priority`, lower served first, honoured by a worker started
with `--scheduling-policy priority`): a class's `engine_priority` is what the gateway sends for its
requests, and only to the instances whose settings say `scheduling_policy: priority`
(conductor/config/instance_spec.py; `discovery.<role>.scheduling_policy` for DNS-found ones). Left
out it is the class's `rank`; `null` sends none. An "fcfs" instance (the default) never gets one: vLLM's
API documents a non-zero priority there as an error. A client's integer `priority` is never passed on
as it came: it is dropped, unless `trust_client_engine_priority` lets it stand where its class sets no
`engine_priority` (or no class is configured), and then it too goes to "priority" instances only.
Start-up error: a less urgent class (higher rank) with a lower `engine_priority` than a more urgent one
(vLLM would serve it first).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conductor.config.groups import Name, TenantSettings
from conductor.config.pools import SloSettings

__all__ = ["PriorityClass", "PrioritySettings", "check_tenant_classes"]

_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriorityClass(_Model):
    """One class (`priority.classes.<name>`)."""

    slo: SloSettings | None = None  # None: the request's model's SLO; a field left out: that one's
    rank: int = Field(default=0, ge=0)  # 0 the most urgent
    sheddable: bool = False  # refused first when the gateway fills up
    # a sheddable class's own share of limits.max_inflight_requests; None: priority.sheddable_share
    share: float | None = Field(default=None, gt=0, le=1)
    # vLLM's `priority` for its requests on "priority" instances (lower first); left out: `rank`;
    # null: none sent. Strict: `true` is not a priority
    engine_priority: int | None = Field(default=None, strict=True)

    def engine(self) -> int | None:
        """The engine priority its requests carry: `engine_priority`, its rank when left out."""
        return self.engine_priority if "engine_priority" in self.model_fields_set else self.rank


class PrioritySettings(_Model):
    classes: Mapping[Name, PriorityClass] = Field(default_factory=dict)
    default: Name | None = None
    header: str = Field(default="x-priority", min_length=1)
    sheddable_share: float = Field(default=0.5, gt=0, le=1)
    # a class less urgent than the most urgent is admitted only within this share of the most urgent
    # class's SLO (policies/classes.py: it must leave that class room)
    guard_margin: float = Field(default=0.5, gt=0, le=1)
    # a client's own integer `priority` is passed on (to "priority" instances only) where its class
    # sets no engine priority; false (the default): dropped, the gateway alone decides
    trust_client_engine_priority: bool = False

    @field_validator("header")
    @classmethod
    def _plain_header(cls, value: str) -> str:
        lowered = value.lower()  # ASGI servers give header names lower-cased
        if not set(lowered) <= _HEADER_CHARS:
            raise ValueError(f"priority.header: {value!r} is not a plain header name (letters, digits, '-', '_')")
        return lowered

    @model_validator(mode="after")
    def _check(self) -> PrioritySettings:
        if not self.classes:
            if self.default is not None:
                raise ValueError(f"priority.default {self.default!r} names a class, but priority.classes lists none")
            return self
        if self.default is None:
            raise ValueError(f"priority.default: name the class of a request that names none, one of {self.names()}")
        if self.default not in self.classes:
            raise ValueError(f"priority.default: {self.default!r} is not a class in priority.classes {self.names()}")
        _check_ranks(self)
        _check_engine_order(self)
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.classes)

    def names(self) -> list[str]:
        """The class names, most urgent first (as the 400 for an unknown class lists them)."""
        return sorted(self.classes, key=lambda name: (self.classes[name].rank, name))

    def engine_priorities(self) -> dict[str, int | None]:
        """class -> the engine priority its requests carry to "priority" instances (None: none)."""
        return {name: c.engine() for name, c in self.classes.items()}

    def shares(self) -> dict[str, float]:
        """sheddable class -> its share of limits.max_inflight_requests."""
        return {name: self.sheddable_share if c.share is None else c.share for name, c in self.classes.items() if c.sheddable}


def _check_ranks(priority: PrioritySettings) -> None:
    """Shed first means least urgent: every sheddable class ranks below every class that is not, and
    among the sheddable ones a less urgent class never has the larger share (it would be shed later)."""
    classes, shares = priority.classes, priority.shares()
    kept = [name for name, c in classes.items() if not c.sheddable]
    for name in shares:
        for other in kept:
            if classes[name].rank <= classes[other].rank:
                raise ValueError(
                    f"priority.classes.{name}: sheddable with rank {classes[name].rank}, as urgent as or more than "
                    f"{other!r} (rank {classes[other].rank}), which is not sheddable; give it a higher rank"
                )
        for other in shares:
            if classes[name].rank > classes[other].rank and shares[name] > shares[other]:
                raise ValueError(
                    f"priority.classes.{name}: share {shares[name]:g} above the more urgent {other!r}'s "
                    f"{shares[other]:g}: the less urgent class would be shed last"
                )


def _check_engine_order(priority: PrioritySettings) -> None:
    """A less urgent class never has the lower engine priority: vLLM would serve it ahead of the urgent one."""
    classes = priority.classes
    sent = {name: c.engine() for name, c in classes.items() if c.engine() is not None}
    for name, mine in sent.items():
        for other, theirs in sent.items():
            if classes[name].rank > classes[other].rank and mine is not None and theirs is not None and mine < theirs:
                raise ValueError(
                    f"priority.classes.{name}.engine_priority: {mine}, below the more urgent {other!r}'s {theirs} "
                    f"(rank {classes[name].rank} vs {classes[other].rank}): vLLM serves the lower priority first"
                )


def check_tenant_classes(priority: PrioritySettings, tenants: Mapping[str, TenantSettings]) -> None:
    """Each tenant's default class is one of `priority.classes` (ValueError naming it otherwise)."""
    for name, tenant in tenants.items():
        if tenant.priority is not None and tenant.priority not in priority.classes:
            known = priority.names() if priority.enabled else "none: priority.classes is empty"
            raise ValueError(f"auth.tenants.{name}.priority: {tenant.priority!r} is not a class in priority.classes ({known})")
