"""One worker as the settings give it: the top-level `prefill`/`decode`/`mixed` lists, a pool's lists
(conductor/config/pools.py) and `POST /admin/instances` all build it. Imports pydantic alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from conductor.core.types import Role


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InstanceSpec(_Model):
    """One worker the gateway routes to."""

    url: str  # base URL, e.g. http://10.0.0.5:8100
    role: Role
    name: str | None = None  # defaults to "<role>-<n>"
    bootstrap_port: int | None = None  # Mooncake / SGLang bootstrap server port on the same host
    # vLLM KV events endpoint exactly as in the worker's --kv-events-config: "tcp://*:5557" (the worker
    # binds, the gateway connects to the worker's host) or "tcp://gateway-host:5557" (the worker connects,
    # the gateway binds there). vLLM's own rule, applied by adapters/kv_events.py.
    kv_events_endpoint: str | None = None
    # vLLM's KV events replay endpoint (--kv-events-config replay_endpoint, e.g. "tcp://*:5558"): the
    # gateway catches up from it at start-up and after gaps (kv.replay_on_start)
    kv_events_replay_endpoint: str | None = None
    # the base models the worker serves, when the settings say so: then these, before and whatever
    # its /v1/models lists (its LoRA adapters are still learned there); None: learned from /v1/models
    models: tuple[str, ...] | None = None
    # the worker's vLLM --scheduling-policy: only a "priority" one gets the requests' engine priority
    # (priority.classes.<c>.engine_priority, conductor/config/priority.py)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"

    @field_validator("models")
    @classmethod
    def _some_models(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        # an empty list would make an instance that serves nothing: a typo, never what was meant
        if v is not None and (not v or not all(v)):
            raise ValueError(
                "an instance's `models` must list at least one non-empty model name "
                "(omit the key to learn them from the worker's /v1/models)"
            )
        return v

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        # Checked here so a bad worker URL is a clear config error, not a traceback at start-up.
        from urllib.parse import urlsplit

        if not v.startswith(("http://", "https://")):
            raise ValueError(f"instance URL must start with http:// or https://: {v!r}")
        parts = urlsplit(v)
        try:
            parts.port  # noqa: B018  (parsing it is the check)
        except ValueError as exc:
            raise ValueError(f"instance URL has an invalid port: {v!r}") from exc
        if not parts.hostname:
            raise ValueError(f"instance URL has no host: {v!r}")
        if parts.username is not None or parts.query or parts.fragment:
            raise ValueError(f"instance URL must be scheme://host[:port][/path], without credentials, query or fragment: {v!r}")
        return v.rstrip("/")


ROLES = ("prefill", "decode", "mixed")


def with_roles(data: dict[str, Any]) -> dict[str, Any]:
    """Let YAML and env say `prefill: [http://a:8100]` or `[{url: ..., bootstrap_port: ...}]`."""
    for role in ROLES:
        if role in data and data[role] is not None:
            items = data[role] if isinstance(data[role], list | tuple) else [data[role]]
            data[role] = [_with_role(it, role) for it in items]
    return data


def _with_role(item: Any, role: str) -> Any:
    if isinstance(item, str):
        return {"url": item, "role": role}
    return {"role": role, **item} if isinstance(item, Mapping) else item  # anything else: pydantic says what is wrong
