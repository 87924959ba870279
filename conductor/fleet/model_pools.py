"""Which members serve which model: the pools a request is routed within, worked out once per change.

A gateway in front of workers that serve different models must send a request for model M only to
the workers that serve M, as a base model or as a LoRA adapter loaded on one (a worker that does
not serves a 404). What each member serves is its `InstanceState.models` and `adapters`, read from
its `/v1/models` by `take_listing` (its cards sorted into base models and adapters,
conductor/core/models.py: an adapter is never counted as a base model of its own; the settings may
list its base models instead); a member whose models are not known yet serves any model, as with
one model behind the gateway.

Per request the router needs the members outside M's pool, to hand them to the policy as excluded
(shown unhealthy, as a failover's failed instances are): so that set is precomputed here, model ->
frozenset of names, and rebuilt only when a member's lists change or a member comes or goes
(conductor/fleet/instances.py). The same rebuild gives the model names the gateway knows (what
`check_model` accepts and `/v1/models` lists) and the context lengths prompts are bounded by.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from conductor.core.models import AdapterCard, adapter_of_card
from conductor.fleet.model_cards import carried_fields
from conductor.fleet.state import InstanceState

__all__ = ["ModelPools", "build_pools", "take_listing"]

_NO_ALIASES: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ModelPools:
    """What the members serve, as the request path reads it."""

    # the configured models, then the members' base models, then their adapters, in membership order
    names: tuple[str, ...] = ()
    # the aliases (public name -> served name) whose served name is among `names`, or every one while
    # no name is known at all (nothing is refused then)
    aliases: Mapping[str, str] = field(default_factory=lambda: _NO_ALIASES)
    # `names` and the aliases' public names: what a request may name (empty: any name, nothing known)
    known: frozenset[str] = frozenset()
    # model -> the members outside its pool: those whose models are known and do not include it
    outside: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # the pool of a model no member lists: only the members whose models are not known yet
    unclaimed: frozenset[str] = frozenset()
    # model -> the smallest context length the members serving it report; and the smallest of all
    contexts: Mapping[str, int] = field(default_factory=dict)
    smallest_context: int | None = None
    # adapter -> its card as the first member (in membership order) lists it: what its KV keys hash
    adapters: Mapping[str, AdapterCard] = field(default_factory=dict)

    def excluded(self, model: str) -> frozenset[str]:
        """The members a request for `model` (a served name, not an alias) must not go to."""
        return self.outside.get(model, self.unclaimed)


def build_pools(
    states: Iterable[InstanceState],
    configured: Iterable[str] = (),
    aliases: Mapping[str, str] | None = None,
    loadable: Mapping[str, str | None] | None = None,
) -> ModelPools:
    """The pools of `states` (the members), with the settings' `models` (`configured`),
    `model_aliases` (`aliases`) and `lora_adapters` (`loadable`: adapter -> its base model or None).
    A loadable adapter no member lists yet is known, and its pool is the members serving its base
    (any member when it names none): the gateway loads it on the one the policy picks
    (conductor/routing/adapter_loads.py)."""
    members = list(states)
    ordered: dict[str, None] = dict.fromkeys(configured)
    for state in members:
        ordered.update(dict.fromkeys(state.models))
    adapters: dict[str, AdapterCard] = {}
    for state in members:
        ordered.update(dict.fromkeys(state.adapters))
        for name, card in state.adapters.items():
            adapters.setdefault(name, card)
    listing = [state for state in members if state.models_known]
    everyone = frozenset(state.name for state in listing)
    outside = {model: frozenset(s.name for s in listing if not s.serves(model)) for model in ordered}
    for adapter, base in (loadable or {}).items():
        if adapter in ordered:
            continue  # listed by a member already: its pool is who holds it
        ordered[adapter] = None
        outside[adapter] = frozenset() if base is None else frozenset(s.name for s in listing if not s.serves(base))
    names = tuple(ordered)
    given = aliases or _NO_ALIASES
    # an alias whose served name nobody serves is unknown like any other name: a 404, not a 503
    live = {a: m for a, m in given.items() if m in ordered} if names else dict(given)
    known = frozenset(names).union(live) if names else frozenset()
    contexts: dict[str, int] = {}
    for state in members:
        for model, length in state.context_lengths.items():
            contexts[model] = min(length, contexts.get(model, length))
    return ModelPools(
        names=names,
        aliases=MappingProxyType(live),
        known=known,
        outside=outside,
        unclaimed=everyone,
        contexts=contexts,
        smallest_context=min(contexts.values(), default=None),
        adapters=adapters,
    )


def take_listing(state: InstanceState, data: object) -> bool:
    """A worker's `/v1/models` list (`data`) taken into its bookkeeping: base models (unless the
    settings list them: `InstanceSpec.models`), adapters, cards and context lengths. True when what
    routing reads (models, adapters, context lengths) changed."""
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)] if isinstance(data, list) else []
    bases: list[str] = []
    adapters: dict[str, AdapterCard] = {}
    for card in cards:
        adapter = adapter_of_card(card)
        if adapter is None:
            bases.append(card["id"])
        else:
            adapters[adapter.name] = adapter
    explicit = state.spec.models
    models = explicit if explicit is not None else tuple(bases)
    lengths = {c["id"]: c["max_model_len"] for c in cards if _positive_int(c.get("max_model_len"))}
    for name, adapter in adapters.items():  # vLLM lists no max_model_len for an adapter: its base's bounds it
        if name not in lengths and adapter.base in lengths:
            lengths[name] = lengths[adapter.base]
    # a worker that lists no base model has told nothing usable: it keeps serving any model
    known = explicit is not None or bool(bases)
    changed = (models, adapters, lengths, known) != (state.models, state.adapters, state.context_lengths, state.models_known)
    state.models, state.adapters, state.context_lengths, state.models_known = models, adapters, lengths, known
    state.model_cards = {c["id"]: carried_fields(c) for c in cards}
    return changed


def _positive_int(value: object) -> bool:
    return type(value) is int and value > 0
