"""The `pools:` settings section: each served model's own instances and SLO, written in one place.

    pools:
      llama: {mixed: [http://llama-0:8000, http://llama-1:8000]}
      qwen:
        prefill: [{url: http://qwen-p0:8000, kv_events_endpoint: "tcp://*:5557"}]
        decode: [http://qwen-d0:8000]
        slo: {ttft_s: 2.0, tbt_s: 0.1}

A pool is a way of writing the instance lists, not a new kind of instance: when the settings are
validated its instances are folded into the top-level `prefill`/`decode`/`mixed` lists, after the
instances listed there (whose default names, "<role>-<i>", do not change), each with `models:
[<the pool's model>]` and, unless it has a name, the name "<model>-<role>-<i>" (a character of the
model's name other than a letter, digit, '.', '_' or '-' written '-': `meta-llama/Llama-3.1-8B`
gives "meta-llama-Llama-3.1-8B-mixed-0"). The registry, the model pools (conductor/fleet/model_pools.py)
and routing see ordinary instances with explicit models. With `models` configured, each pool's
model is added to it (a pool's key is a served model name: it need not be repeated there).

A pool's `slo` overrides the gateway-wide `slo` field by field for requests of its model (a field it
leaves out is the gateway's, `null` says none); per-request SLO headers override both
(`Router.slo_for`, precomputed by `pool_slos`).

Start-up errors, each naming `pools.<model>`: a pool with no instances; prefill instances without
decode ones or the reverse; mixed instances beside prefill/decode ones (the policy would send the
model's requests to the P/D pairs only); an instance listed under a role other than its own; an
instance whose own `models` leave out the pool's model; a pool's model that is also an alias in
`model_aliases`. Imports pydantic and conductor.config.instance_spec only (conductor/config/settings.py
imports this).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from conductor.config.instance_spec import ROLES, InstanceSpec, with_roles

__all__ = ["PoolSettings", "SloSettings", "fold_pools", "pool_slos"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")  # what an instance name may not hold (a metric label, a URL segment)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SloSettings(_Model):
    ttft_s: float | None = None
    tbt_s: float | None = None


class PoolSettings(_Model):
    """One model's instances and SLO (`pools.<model>`); once folded, its instances carry their
    names and `models: [<model>]` as the top-level lists hold them."""

    prefill: tuple[InstanceSpec, ...] = ()
    decode: tuple[InstanceSpec, ...] = ()
    mixed: tuple[InstanceSpec, ...] = ()
    slo: SloSettings | None = None  # None: the gateway-wide `slo`

    def instances(self) -> tuple[InstanceSpec, ...]:
        return (*self.prefill, *self.decode, *self.mixed)


def fold_pools(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The settings' raw values with each pool's instances folded into the top-level lists (see the
    module docstring) and `pools` as validated PoolSettings; `data` itself when it has no pools.
    Raises ValueError naming `pools.<model>` on the first bad pool. Folding twice adds nothing: an
    instance already listed (same URL and name) is not listed again."""
    given = data.get("pools")
    if not given or not isinstance(given, Mapping):
        return data  # none, or not a mapping: the field's own validation says so
    out = dict(data)
    aliases = out.get("model_aliases")
    pools: dict[str, PoolSettings] = {}
    for model, raw in given.items():
        where = f"pools.{model}"
        if not isinstance(model, str) or not model:
            raise ValueError(f"pools: a pool's key is the served model's name, a non-empty string; got {model!r}")
        pool = _pool(where, raw)
        _check_pool(where, model, pool, aliases if isinstance(aliases, Mapping) else {})
        pools[model] = folded = _folded(model, pool)
        for role in ROLES:
            _append(out, role, getattr(folded, role))
    out["pools"] = pools
    models = out.get("models")
    if models and isinstance(models, list | tuple):
        out["models"] = [*models, *(model for model in pools if model not in models)]
    return out


def pool_slos(default: SloSettings, pools: Mapping[str, PoolSettings]) -> dict[str, SloSettings]:
    """model -> its SLO, for the pools that set one: the pool's fields over `default`'s."""
    return {
        model: default.model_copy(update={key: getattr(pool.slo, key) for key in pool.slo.model_fields_set})
        for model, pool in pools.items()
        if pool.slo is not None
    }


def _pool(where: str, raw: Any) -> PoolSettings:
    if isinstance(raw, PoolSettings):
        return raw
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a mapping of prefill/decode/mixed instance lists and slo, got {raw!r}")
    try:
        return PoolSettings.model_validate(with_roles(dict(raw)))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join([where, *(str(p) for p in err['loc'])])}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        )
        raise ValueError(problems) from None


def _check_pool(where: str, model: str, pool: PoolSettings, aliases: Mapping[Any, Any]) -> None:
    if model in aliases:
        raise ValueError(
            f"{where}: {model!r} is also an alias in model_aliases (to {aliases[model]!r}); "
            "a pool is keyed by the model its instances serve, the name an alias maps to"
        )
    if not pool.instances():
        raise ValueError(f"{where}: no instances: give it prefill and decode instances, or mixed ones")
    if bool(pool.prefill) != bool(pool.decode):
        have, lacking = ("prefill", "decode") if pool.prefill else ("decode", "prefill")
        raise ValueError(f"{where}: {have} instances without {lacking} ones: a P/D pool needs both")
    if pool.mixed and pool.prefill:
        raise ValueError(
            f"{where}: mixed instances beside prefill/decode ones: the model's requests would go to the "
            "P/D pairs only; give the pool one kind"
        )
    for role in ROLES:
        for spec in getattr(pool, role):
            if spec.role.value != role:
                raise ValueError(f"{where}: instance {spec.url} is listed under {role} but has role {spec.role.value}")
            if spec.models is not None and model not in spec.models:
                raise ValueError(
                    f"{where}: instance {spec.url} lists models {list(spec.models)} without {model!r}: "
                    "a pool's instances serve its model (leave their `models` out)"
                )


def _folded(model: str, pool: PoolSettings) -> PoolSettings:
    """`pool` with each instance named (unless it is) and serving `model` (unless it says what)."""
    prefix = _UNSAFE.sub("-", model).strip("-") or "pool"
    update = {
        role: tuple(
            spec.model_copy(update={"name": spec.name or f"{prefix}-{role}-{i}", "models": spec.models or (model,)})
            for i, spec in enumerate(getattr(pool, role))
        )
        for role in ROLES
    }
    return pool.model_copy(update=update)


def _append(out: dict[str, Any], role: str, specs: tuple[InstanceSpec, ...]) -> None:
    """`specs` after the top-level `role` list (unless listed there already)."""
    current = out.get(role)
    if not specs or not isinstance(current, list | tuple | None):
        return  # a top-level list that is not one: its own validation says so
    listed = {(_field(it, "url"), _field(it, "name")) for it in current or ()}
    out[role] = [*(current or ()), *(spec for spec in specs if (spec.url, spec.name) not in listed)]


def _field(item: Any, key: str) -> Any:
    value = item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)
    return value.rstrip("/") if key == "url" and isinstance(value, str) else value
