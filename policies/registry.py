"""Loading policies by name from the `conductor.policies` entry-point group.

A name resolves to an entry point whose object is a Policy class or a factory; it is called with
the configured options and the result is checked against the Policy protocol. Anything wrong is a
PluginError, which stops start-up with a message naming the plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from conductor.core.errors import ConfigError, PluginError
from conductor.core.types import Policy

GROUP = "conductor.policies"


def available_policies() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_policy(name: str, options: Mapping[str, Any] | None = None) -> Policy:
    eps = available_policies()
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise PluginError(f"policy {name!r} is not registered in entry-point group {GROUP!r} (known: {known})")
    ep = eps[name]
    try:
        factory = ep.load()
    except Exception as exc:  # a broken plugin must fail start-up loudly, whatever it raised
        raise PluginError(f"policy plugin {name!r} ({ep.value}) failed to import: {exc!r}") from exc
    try:
        policy = factory(**dict(options or {}))
    except ConfigError as exc:  # a checked option: its message names the key and what it allows
        raise PluginError(f"policy plugin {name!r} ({ep.value}) failed to construct: {exc}") from exc
    except Exception as exc:
        raise PluginError(f"policy plugin {name!r} ({ep.value}) failed to construct: {exc!r}") from exc
    check_policy(policy, origin=f"{name!r} ({ep.value})")
    return policy


def check_policy(policy: object, *, origin: str) -> Policy:
    problems = []
    if not isinstance(getattr(policy, "name", None), str):
        problems.append("has no string attribute 'name'")
    for method in ("decide", "on_decided", "observe"):
        if not callable(getattr(policy, method, None)):
            problems.append(f"has no method {method}()")
    if problems or not isinstance(policy, Policy):
        raise PluginError(f"policy plugin {origin} does not satisfy the Policy protocol: {'; '.join(problems)}")
    return policy
