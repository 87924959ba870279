"""The flat settings keys of before the groups (conductor/config/groups.py), still accepted.

Each old key (`pd_readback_ttl_s` in YAML, `CONDUCTOR_PD_READBACK_TTL_S` in the environment, or a
keyword of `Settings(...)`) is moved to its group (`pd.readback_ttl_s`) and warned about once, naming
the new key. One source giving both the old and the new key is a ConfigError: which one was meant
cannot be told. Across sources the usual precedence applies (an old environment variable still
overrides the new key in the file), so a deployment can move its file and its environment one at a time.

The warning is a FutureWarning (DeprecatedSettingWarning): Python shows those by default, while a
DeprecationWarning is hidden outside `__main__` and test runners. The people who must act on it are
the operators who wrote the config, not developers of code that imports ours.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, create_model

from conductor.config.env import env_values
from conductor.core.errors import ConfigError

# old flat key -> "group.key". A group's own old key (`load_share: redis`, now `load_share.mode`) is
# moved before its siblings (see _ORDER), so they land in the mapping it became.
MOVED: Mapping[str, str] = {
    "pd_protocol": "pd.protocol",
    "mooncake_schema": "pd.mooncake_schema",
    "pd_readback": "pd.readback",
    "pd_readback_ttl_s": "pd.readback_ttl_s",
    "pd_readback_max_handles": "pd.readback_max_handles",
    "pd_peer_pull": "pd.peer_pull",
    "pd_pull_min_tokens": "pd.pull_min_tokens",
    "pd_peer_pull_lease_s": "pd.peer_pull_lease_s",
    "pd_peer_pull_priority": "pd.peer_pull_priority",
    "trust_client_kv_transfer_params": "pd.trust_client_kv_transfer_params",
    "api_keys": "auth.api_keys",
    "api_keys_file": "auth.api_keys_file",
    "admin_api_keys": "auth.admin_api_keys",
    "admin_api_keys_file": "auth.admin_api_keys_file",
    "upstream_api_key": "auth.upstream_api_key",
    "upstream_api_key_file": "auth.upstream_api_key_file",
    "connect_timeout_s": "timeouts.connect_s",
    "request_timeout_s": "timeouts.request_s",
    "read_timeout_s": "timeouts.read_s",
    "bootstrap_timeout_s": "timeouts.bootstrap_s",
    "drain_grace_s": "timeouts.drain_grace_s",
    "keep_alive_timeout_s": "timeouts.keep_alive_s",
    "max_body_bytes": "limits.max_body_bytes",
    "max_attempts": "limits.max_attempts",
    "max_connections_per_upstream": "limits.max_connections_per_upstream",
    "max_inflight_requests": "limits.max_inflight_requests",
    "outlier_consecutive_errors": "outlier.consecutive_errors",
    "outlier_ejection_s": "outlier.ejection_s",
    "outlier_max_ejection_s": "outlier.max_ejection_s",
    "outlier_max_ejected_fraction": "outlier.max_ejected_fraction",
    "health_interval_s": "health.interval_s",
    "health_unhealthy_interval_s": "health.unhealthy_interval_s",
    "health_timeout_s": "health.timeout_s",
    "unhealthy_after": "health.unhealthy_after",
    "min_ready_prefill": "health.min_ready_prefill",
    "min_ready_decode": "health.min_ready_decode",
    "load_share": "load_share.mode",
    "redis_url": "load_share.redis_url",
    "replica_id": "load_share.replica_id",
    "load_sync_interval_s": "load_share.sync_interval_s",
    "load_sync_max_age_s": "load_share.sync_max_age_s",
    "load_share_timeout_s": "load_share.timeout_s",
    "load_share_breaker_failures": "load_share.breaker_failures",
    "load_share_breaker_open_s": "load_share.breaker_open_s",
    "otlp_traces_endpoint": "tracing.otlp_endpoint",
    "trace_sample_ratio": "tracing.sample_ratio",
    "service_name": "tracing.service_name",
    "log_format": "logs.format",
    "access_log": "logs.access_log",
    "log_level": "logs.level",
}
_ORDER = sorted(MOVED, key=lambda old: old != MOVED[old].partition(".")[0])
# old list keys a single plain environment value may give (one key), as their new places do
_PLAIN_LISTS = ("api_keys", "admin_api_keys")


class DeprecatedSettingWarning(FutureWarning):
    """An old flat settings key was given; its message names the key to use instead."""


def env_name(key: str, prefix: str) -> str:
    """The environment variable of a settings key: `pd.readback_ttl_s` -> CONDUCTOR_PD__READBACK_TTL_S."""
    return prefix + key.replace(".", "__").upper()


def _is_old(key: str, value: Any) -> bool:
    # `load_share` is both an old key (a mode: "redis") and the new group (a mapping or its model)
    return key in MOVED and (key != "load_share" or isinstance(value, str))


def move_flat_keys(data: Mapping[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """`data` with every old flat key moved into its group, and the old keys found (in MOVED's order).
    Raises ConfigError when `source` (a file, "environment", ...) gives a setting both ways."""
    out = dict(data)
    found: list[str] = []
    for old in _ORDER:
        if old not in out or not _is_old(old, out[old]):
            continue
        value = out.pop(old)
        group, _, key = MOVED[old].partition(".")
        current = out.get(group, {})
        if current is None:
            current = {}
        elif isinstance(current, BaseModel):  # Settings(pd=PdSettings(...), pd_peer_pull="on")
            current = current.model_dump(exclude_unset=True)
        if not isinstance(current, Mapping):
            raise ConfigError(f"invalid configuration ({source}): '{group}' must be a mapping, got {current!r}")
        if key in current:
            new = MOVED[old]
            raise ConfigError(f"invalid configuration ({source}): both '{old}' (deprecated) and '{new}' given: keep only '{new}'")
        out[group] = {**current, key: value}
        found.append(old)
    return out, found


def warn_moved(old_keys: Iterable[str], prefix: str) -> None:
    """One warning per old key, naming its new place (in the file and in the environment)."""
    for old in dict.fromkeys(old_keys):
        new = MOVED[old]
        warnings.warn(
            f"setting '{old}' is deprecated: use '{new}' (environment: {env_name(new, prefix)} instead of "
            f"{env_name(old, prefix)})",
            DeprecatedSettingWarning,
            stacklevel=3,
        )


def split_env(environ: Mapping[str, str], prefix: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the environment without the old flat variables, those old variables). CONDUCTOR_LOAD_SHARE
    is old when it names a mode; as a JSON object it is the new group."""
    old_names = {env_name(old, prefix): old for old in MOVED}
    rest: dict[str, str] = {}
    old: dict[str, str] = {}
    for name, value in environ.items():
        key = old_names.get(name.upper())
        if key is None or (key == "load_share" and value.lstrip().startswith("{")):
            rest[name] = value
        else:
            old[name] = value
    return rest, old


def old_env_values(settings_model: type[BaseModel], environ: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The values of old flat variables, keyed by old name and decoded as their new fields' types."""
    if not environ:
        return {}
    fields: dict[str, Any] = {}
    for old, new in MOVED.items():
        group, _, key = new.partition(".")
        group_model = settings_model.model_fields[group].annotation
        assert isinstance(group_model, type) and issubclass(group_model, BaseModel)
        fields[old] = (group_model.model_fields[key].annotation, None)
    view = create_model("FlatSettings", **fields)
    return env_values(view, environ, prefix, _PLAIN_LISTS)
