"""The one typed settings object, built at start-up and passed in.

Precedence, lowest first: defaults, the YAML file (`--config`), environment variables
(`CONDUCTOR_<FIELD>`, nested fields joined with `__`, parsed by pydantic-settings from the
model's own types: see conductor/config/env.py), then command-line flags.

Instance lists are the exception to "the higher one replaces": instances given as flags
(`overrides`: `--prefill`, `--decode`, `--mixed`) are merged into the list of that role from the
file and environment, by URL. A flag naming a URL already listed updates that entry with what the
flag gives (a bootstrap port) and keeps the rest (name, kv_events_endpoint, bootstrap_port unless
given); a new URL is appended. So a flag can add or adjust a worker without losing its KV events
endpoint. Environment lists still replace the file's.

`pools:` (served model -> its instance lists and SLO) is another way of writing the instance lists:
each pool's instances are folded into them when the settings are validated, with `models: [<model>]`
and a name of their own (conductor/config/pools.py); the instance model is conductor/config/instance_spec.py.

Fields are grouped by concern (`pd:`, `auth:`, `timeouts:`, `limits:`, `outlier:`, `health:`,
`load_share:`, `tracing:`, `logs:`: conductor/config/groups.py); what is truly the gateway's own
(host, port, instance lists, models, policy, slo, priority, kv) stays at the top. The old flat keys of the
grouped fields (`pd_readback_ttl_s`, CONDUCTOR_HEALTH_INTERVAL_S) are still read, each source's moved
to its group with one warning a key (conductor/config/legacy.py). This package imports nothing
heavier than pydantic, yaml and conductor.core, so building settings loads no I/O library.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from conductor.config.env import env_values
from conductor.config.groups import (
    AuthSettings,
    HealthSettings,
    HoldSettings,
    LimitSettings,
    LoadShareSettings,
    LogSettings,
    OutlierSettings,
    PdSettings,
    TimeoutSettings,
    TracingSettings,
)
from conductor.config.instance_spec import InstanceSpec, with_roles
from conductor.config.kv import KVAwarenessSettings
from conductor.config.legacy import move_flat_keys, old_env_values, split_env, warn_moved
from conductor.config.pools import PoolSettings, SloSettings, fold_pools
from conductor.config.priority import PrioritySettings, check_tenant_classes
from conductor.config.sessions import SessionSettings
from conductor.core.errors import ConfigError
from conductor.core.types import Role

ENV_PREFIX = "CONDUCTOR_"
# list settings a single plain environment value may give (one key, one model, one worker URL)
_PLAIN_LISTS = ("auth.api_keys", "auth.admin_api_keys", "models", "prefill", "decode", "mixed")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DnsSource(_Model):
    """One role's workers found by DNS (conductor/fleet/membership.py): every A record of `name` (a Kubernetes
    headless Service) is an instance named "<role>-<address>" at <scheme>://<address>:<port>."""

    name: str = Field(min_length=1)  # e.g. conductor-prefill.default.svc.cluster.local
    port: int = Field(gt=0, lt=65536)  # the workers' HTTP port
    scheme: Literal["http", "https"] = "http"
    # the workers bind their KV events PUB (and replay ROUTER) on these ports: "tcp://*:PORT"
    kv_events_port: int | None = Field(default=None, gt=0, lt=65536)
    kv_events_replay_port: int | None = Field(default=None, gt=0, lt=65536)
    bootstrap_port: int | None = Field(default=None, gt=0, lt=65536)  # Mooncake / SGLang prefills
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # the workers' vLLM --scheduling-policy


class DiscoverySettings(_Model):
    """Instances that join and leave at run time, found by DNS; the static lists stay as they are."""

    prefill: DnsSource | None = None
    decode: DnsSource | None = None
    mixed: DnsSource | None = None
    interval_s: float = Field(default=10.0, gt=0)  # how often every name is resolved again
    timeout_s: float = Field(default=2.0, gt=0)  # one resolution, retries included
    # the DNS server to ask (an IP address); unset: the system's, from /etc/resolv.conf (Kubernetes)
    nameserver: str | None = None
    nameserver_port: int = Field(default=53, gt=0, lt=65536)

    def sources(self) -> dict[Role, DnsSource]:
        return {
            role: src
            for role, src in ((Role.PREFILL, self.prefill), (Role.DECODE, self.decode), (Role.MIXED, self.mixed))
            if src is not None
        }


class LoraAdapterSpec(_Model):
    """A LoRA adapter the gateway may load on a worker at run time (`lora_adapters`)."""

    path: str = Field(min_length=1)  # vLLM's lora_path: what the worker loads, and hashes into its blocks
    base: str | None = Field(default=None, min_length=1)  # the base model it goes on; None: any worker's


class Settings(_Model):
    host: str = "127.0.0.1"
    port: int = 8000
    admin_port: int | None = None  # if set, /metrics, /openapi.json and /docs are served only here
    # gateway processes on `port` (SO_REUSEPORT), scheduling as one through shared memory
    # (conductor/server/serving.py); worker i serves its admin routes on admin_port + i, so > 1 needs admin_port
    workers: int = Field(default=1, ge=1, le=256)
    # with workers > 1: each worker's policy predictors also learn from its siblings' outcomes
    # (predictors/lessons.py, adapters/lesson_share.py); off: each learns from its own requests only
    share_lessons: bool = True

    prefill: tuple[InstanceSpec, ...] = ()
    decode: tuple[InstanceSpec, ...] = ()
    mixed: tuple[InstanceSpec, ...] = ()
    # workers found by DNS at run time, beside the lists above (conductor/fleet/membership.py)
    discovery: DiscoverySettings = DiscoverySettings()
    models: tuple[str, ...] = ()  # served model names; empty: ask the workers' /v1/models
    # served model name -> its own instances and SLO, folded into the lists above with `models: [name]`
    # when validated; each pool's name is added to a configured `models` (conductor/config/pools.py)
    pools: Mapping[str, PoolSettings] = Field(default_factory=dict)
    # public name -> served name: a request for the public name is routed and forwarded as the
    # served one (conductor/fleet/model_pools.py); /v1/models lists both
    model_aliases: Mapping[str, str] = Field(default_factory=dict)
    # adapter name -> {path, base}: a request naming one that no worker lists loads it first on the
    # worker chosen (POST /v1/load_lora_adapter; conductor/routing/adapter_loads.py)
    lora_adapters: Mapping[Annotated[str, Field(min_length=1)], LoraAdapterSpec] = Field(default_factory=dict)
    # Conductor's own scheduler (policies/kvcache_aware/): by predicted TTFT/TBT and what each worker
    # has cached (kv: below). "round_robin" and the other registered policies are a setting away
    policy: str = "kvcache_aware"
    policy_options: Mapping[str, Any] = Field(default_factory=dict)
    slo: SloSettings = SloSettings()
    # request classes (their SLOs, which are shed first) and the default one: conductor/config/priority.py
    priority: PrioritySettings = PrioritySettings()
    # where a request names its session (header, prompt_cache_key, user): conductor/config/sessions.py
    sessions: SessionSettings = SessionSettings()
    default_max_tokens: int = 256  # assumed output length when a request sets none

    block_size: int = 16  # tokens per KV block: must equal the workers' --block-size
    # KV-cache awareness: tokenizer, block keys, the cache index and its feeds (conductor/kv/analyzer.py).
    # Its block size is the one above; its KV event endpoints default to each instance's kv_events_endpoint.
    kv: KVAwarenessSettings = KVAwarenessSettings()
    # every this many seconds: one full garbage collection, then everything that survived is frozen
    # out of later ones (conductor/ops/gc_freeze.py: a big KV index otherwise makes each full pass a
    # tens-of-milliseconds stall in the p99); None: Python's default collector alone
    gc_freeze_interval_s: float | None = Field(default=60.0, gt=0)

    # one group per concern (conductor/config/groups.py); their old flat keys: conductor/config/legacy.py
    pd: PdSettings = PdSettings()
    auth: AuthSettings = AuthSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    limits: LimitSettings = LimitSettings()
    hold: HoldSettings = HoldSettings()
    outlier: OutlierSettings = OutlierSettings()
    health: HealthSettings = HealthSettings()
    load_share: LoadShareSettings = LoadShareSettings()
    tracing: TracingSettings = TracingSettings()
    logs: LogSettings = LogSettings()

    @model_validator(mode="before")
    @classmethod
    def _move_flat_keys(cls, data: Any) -> Any:
        # Settings(pd_protocol=...) and model_validate of an old flat mapping: load_settings has
        # moved (and warned about) its sources' old keys already, so this finds none there
        if not isinstance(data, Mapping):
            return data
        moved, old = move_flat_keys(data, "settings")
        warn_moved(old, ENV_PREFIX)
        return fold_pools(moved)  # pools: folded into the instance lists here (conductor/config/pools.py)

    @model_validator(mode="after")
    def _check_roles(self) -> Settings:
        for role, specs in (("prefill", self.prefill), ("decode", self.decode), ("mixed", self.mixed)):
            for spec in specs:
                if spec.role.value != role:
                    raise ValueError(f"instance {spec.url} is listed under {role} but has role {spec.role}")
        names = [spec.name for spec in self.instances()]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique: {names}")
        if "block_size" in self.kv.model_fields_set and self.kv.block_size != self.block_size:
            raise ValueError(f"kv.block_size {self.kv.block_size} differs from block_size {self.block_size}: set block_size only")
        _check_aliases(self)
        check_tenant_classes(self.priority, self.auth.tenants)
        pd = self.pd
        if pd.peer_pull == "on" and not (pd.protocol == "nixl" and self.kv.enabled and self.decode):
            raise ValueError(
                "pd.peer_pull 'on' needs --pd-protocol nixl, decode instances and kv.enabled "
                "(the staging request names the prefix by the gateway's token ids)"
            )
        if pd.protocol in ("mooncake", "sglang"):
            missing = [p.url for p in self.prefill if p.bootstrap_port is None]
            if missing:
                raise ValueError(f"--pd-protocol {pd.protocol} needs a bootstrap port for prefill {missing}")
            if self.discovery.prefill is not None and self.discovery.prefill.bootstrap_port is None:
                raise ValueError(f"--pd-protocol {pd.protocol} needs discovery.prefill.bootstrap_port")
        return self

    def instances(self) -> tuple[InstanceSpec, ...]:
        """Every instance, each with its name filled in."""
        out = []
        for specs in (self.prefill, self.decode, self.mixed):
            for n, spec in enumerate(specs):
                out.append(spec if spec.name else spec.model_copy(update={"name": f"{spec.role.value}-{n}"}))
        return tuple(out)

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode or self.discovery.prefill or self.discovery.decode)


def _check_aliases(settings: Settings) -> None:
    """Each alias names a served model: not another alias nor a configured model's own name, and,
    with `models` configured, a model that `models` or an instance's `models` lists."""
    aliases = settings.model_aliases
    configured = set(settings.models).union(*(spec.models or () for spec in settings.instances()))
    for public, served in aliases.items():
        if not public or not served:
            raise ValueError(f"model_aliases: names must be non-empty, got {public!r}: {served!r}")
        if served in aliases:
            raise ValueError(f"model_aliases: {public!r} names {served!r}, itself an alias; name the served model")
        if public in configured:
            raise ValueError(f"model_aliases: {public!r} is also a served model's name in the settings")
        if settings.models and served not in configured:
            raise ValueError(
                f"model_aliases: {public!r} names {served!r}, which neither `models` nor any instance's `models` lists"
            )


def merge_settings(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `top` over it, mappings merged key by key (a group's other fields kept)."""
    merged = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            merged[k] = merge_settings(dict(merged[k]), v)
        else:
            merged[k] = v
    return merged


def _url_key(url: Any) -> str:
    return str(url).rstrip("/")


def _merge_instances(data: Mapping[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """`flags` with each role's instance list merged into `data`'s by URL (see the module docstring).
    Both are already in `with_roles` form: lists of dicts with url and role."""
    for role in ("prefill", "decode", "mixed"):
        given, listed = flags.get(role), data.get(role)
        if not given or not isinstance(listed, list | tuple) or not listed:
            continue
        merged = [dict(spec) for spec in listed]
        where = {_url_key(spec.get("url")): i for i, spec in enumerate(merged)}
        for spec in given:
            i = where.get(_url_key(spec.get("url")))
            if i is None:
                where[_url_key(spec.get("url"))] = len(merged)
                merged.append(dict(spec))
            else:  # the flag's fields win; its URL spelling (a trailing slash) does not matter
                merged[i] = {**merged[i], **{k: v for k, v in spec.items() if k != "url"}}
        flags[role] = merged
    return flags


def load_settings(
    config_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the settings object; any problem is a ConfigError that names the field. Each source's
    old flat keys are moved to their groups first (conductor/config/legacy.py), one warning a key."""
    data: dict[str, Any] = {}
    old_keys: list[str] = []
    if config_file is not None:
        data, old_keys = move_flat_keys(with_roles(_read_file(config_file)), str(config_file))
    env, old_env_keys = _from_environment(os.environ if environ is None else environ)
    data = merge_settings(data, with_roles(env))
    old_keys += old_env_keys
    if overrides:
        given, old_flag_keys = move_flat_keys({k: v for k, v in overrides.items() if v is not None}, "overrides")
        old_keys += old_flag_keys
        flags = with_roles(given)
        data = merge_settings(data, _merge_instances(data, flags))
    warn_moved(old_keys, ENV_PREFIX)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from exc


def _read_file(config_file: str | Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {config_file} must hold a mapping at the top level")
    return loaded


def _from_environment(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The CONDUCTOR_* values, old flat variables (CONDUCTOR_PD_PROTOCOL) moved to their groups,
    and the old keys found."""
    current, old = split_env(environ, ENV_PREFIX)
    try:
        values = env_values(Settings, current, ENV_PREFIX, _PLAIN_LISTS)
        values.update(old_env_values(Settings, old, ENV_PREFIX))
    except ValueError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    return move_flat_keys(values, "environment")
