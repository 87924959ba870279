"""The gateway's `/v1/models` answer, built from the model cards its workers list.

A client reads a served model's card to learn what it may send: vLLM's `max_model_len` bounds the
prompt plus the output, `root` and `parent` name the weights (and the base model of a LoRA adapter),
`owned_by` and `permission` are what vLLM's ModelCard carries. The gateway answers for every worker
behind it, so it passes those fields on as the workers listed them, with one rule for a model
several workers serve: the smallest `max_model_len`, since a request may land on any of them (the
same bound conductor/kv/prompt_bounds.py applies to prompts). A model that the settings name but
no worker has listed yet gets a bare card owned by "conductor"; an alias (`model_aliases`) a card
of its own whose `root` is the served name.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from conductor.fleet.state import InstanceState

__all__ = ["CARRIED_FIELDS", "alias_card", "carried_fields", "model_list", "served_card"]

# vLLM's ModelCard fields past id/object/created: what the gateway passes on from its workers
CARRIED_FIELDS = ("owned_by", "root", "parent", "max_model_len", "permission")


def carried_fields(card: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of one worker's card that the gateway passes on (the ones it lists)."""
    return {key: card[key] for key in CARRIED_FIELDS if key in card}


def _smaller_length(a: object, b: object) -> object:
    """The smaller of two max_model_len values; a value that is not a positive int loses to one that is."""
    lengths = [x for x in (a, b) if type(x) is int and x > 0]
    return min(lengths) if lengths else a


def served_card(model: str, states: Iterable[InstanceState], created: int) -> dict[str, Any]:
    """`model`'s card as the gateway lists it: the first worker's fields (in membership order),
    the smallest max_model_len of all the workers that list it."""
    card: dict[str, Any] = {"id": model, "object": "model", "created": created}
    seen = False
    for state in states:
        fields = state.model_cards.get(model)
        if fields is None:
            continue
        if not seen:
            card.update(fields)
            seen = True
        elif "max_model_len" in fields:
            card["max_model_len"] = _smaller_length(card.get("max_model_len"), fields["max_model_len"])
    if not seen:
        card["owned_by"] = "conductor"
    return card


def alias_card(alias: str, served: Mapping[str, Any]) -> dict[str, Any]:
    """An alias's card: the served model's card (`served`, as `served_card` made it) under the
    alias's id, `root` naming the served model; no `parent`, so no client takes it for an adapter."""
    card = {key: value for key, value in served.items() if key != "parent"}
    card["id"], card["root"] = alias, served["id"]
    return card


def model_list(
    models: Iterable[str],
    states: Iterable[InstanceState],
    created: int | None = None,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The `/v1/models` body for `models` served by the members `states`, then `aliases` (public
    name -> served name)."""
    members = list(states)
    stamp = int(time.time()) if created is None else created
    data = [served_card(m, members, stamp) for m in models]
    if aliases:
        by_id = {card["id"]: card for card in data}
        for alias, target in aliases.items():
            data.append(alias_card(alias, by_id.get(target) or served_card(target, members, stamp)))
    return {"object": "list", "data": data}
