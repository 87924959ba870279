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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from conductor.config.env import env_values
from conductor.core.errors import ConfigError
from conductor.core.types import Role
from conductor.kv.analyzer import KVAwarenessSettings

ENV_PREFIX = "CONDUCTOR_"
# list settings a single plain environment value may give (one key, one model, one worker URL)
_PLAIN_LISTS = ("api_keys", "admin_api_keys", "models", "prefill", "decode", "mixed")


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


class SloSettings(_Model):
    ttft_s: float | None = None
    tbt_s: float | None = None


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
    # logs: "text" lines or one JSON object a line; an access log line per request (no prompt text)
    log_format: Literal["text", "json"] = "text"
    access_log: bool = False
    # OpenTelemetry traces over OTLP/HTTP (e.g. http://collector:4318/v1/traces); off when unset
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    service_name: str = "conductor"
    log_level: str = "info"

    prefill: tuple[InstanceSpec, ...] = ()
    decode: tuple[InstanceSpec, ...] = ()
    mixed: tuple[InstanceSpec, ...] = ()
    # workers found by DNS at run time, beside the lists above (conductor/fleet/membership.py)
    discovery: DiscoverySettings = DiscoverySettings()
    pd_protocol: Literal["nixl", "mooncake", "sglang"] = "nixl"
    # which generation of vLLM's MooncakeConnector field names to speak (adapters/pd/mooncake.py)
    mooncake_schema: str = "transfer_id"
    # Decode-to-prefill readback (conductor/routing/readback.py): NIXL decodes started with
    # kv_connector_extra_config {"bidirectional_kv_xfer": true} hand back where a finished request's
    # KV is pinned; the next turn's prefill may pull its shared prefix from there instead of
    # recomputing it. "auto": offered to the policy wherever decodes hand such KV back (NIXL only,
    # KV awareness on: block keys tell which prefix matches); "off": never. No other protocol has a
    # pull the gateway can drive, so there the policy is offered none.
    pd_readback: Literal["auto", "off"] = "auto"
    # never offer a handle older than this: below the workers' decoder_kv_blocks_ttl (480 s by default)
    pd_readback_ttl_s: float = Field(default=240.0, gt=0)
    pd_readback_max_handles: int = Field(default=100_000, gt=0)
    # Prefill-to-prefill pulls (conductor/routing/peer_pull.py): a prefill that lacks a prefix another
    # prefill holds pulls it over NIXL after a one-token staging request on the holder pins its
    # blocks. Needs NIXL, KV awareness, the gateway's token ids being the workers' own (a model
    # tokenizer, kv.forward_token_ids) and every prefill started with bidirectional_kv_xfer.
    # "auto": on once a decode has handed back bidirectional kv_transfer_params (the cluster runs
    # bidirectional_kv_xfer); "on": from the start (the conditions checked at start-up); "off": never.
    pd_peer_pull: Literal["auto", "on", "off"] = "auto"
    # the workers' kv_recompute_threshold: vLLM skips a pull of fewer tokens, so none is planned
    pd_pull_min_tokens: int = Field(default=64, ge=0)
    # the prefills' kv_lease_duration: a staged prefix stays pinned this long for the reader, so no
    # pull is staged for a request predicted to reach its prefill later than half of it
    pd_peer_pull_lease_s: float = Field(default=30.0, gt=0)
    # vLLM `priority` of staging requests, where the prefills run --scheduling-policy priority: set it
    # below the clients' (0), e.g. -1, and a staging request waits only for the prefill running on the
    # holder instead of its whole queue. None: sent without one, so it queues FCFS
    pd_peer_pull_priority: int | None = None

    models: tuple[str, ...] = ()  # served model names; empty: ask the workers' /v1/models
    policy: str = "round_robin"
    policy_options: Mapping[str, Any] = Field(default_factory=dict)
    slo: SloSettings = SloSettings()
    default_max_tokens: int = 256  # assumed output length when a request sets none

    # secrets: never printed (SecretStr), and may come from files Kubernetes mounts from a Secret
    api_keys: tuple[SecretStr, ...] = ()  # if set, clients must send one as a Bearer token
    api_keys_file: str | None = None  # more keys, one per line ('#' lines and blank lines skipped)
    # the admin API (/admin/instances: conductor/fleet/membership.py) takes only these keys; with none it is off
    admin_api_keys: tuple[SecretStr, ...] = ()
    admin_api_keys_file: str | None = None  # more admin keys, one per line, like api_keys_file
    upstream_api_key: SecretStr | None = None  # sent to workers instead of the client's key
    upstream_api_key_file: str | None = None  # the upstream key from a file (its first line)
    max_body_bytes: int = 16 * 1024 * 1024

    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # whole request, from admission to its last byte: past it, 504
    read_timeout_s: float = 120.0  # longest silence from a worker before 504
    bootstrap_timeout_s: float = 5.0
    # on SIGTERM: stop accepting, let requests in flight finish for this long, then close them
    drain_grace_s: float = 30.0
    # how long a client's connection may sit idle between requests (and take to send a request's
    # head or go silent mid-body) before the gateway closes it. Longer than every common client's
    # and proxy's own idle expiry (httpx 5 s, aiohttp 15 s, nginx upstream 60 s): a client that
    # reuses a connection the server is closing at that moment loses its request ("server
    # disconnected"), which uvicorn's 5 s default makes routine under load. nginx's keepalive_timeout
    keep_alive_timeout_s: float = Field(default=75.0, gt=0)
    # a request whose leg failed before any byte reached the client (connection refused, a worker's
    # 5xx) is decided again without that instance, up to this many attempts in all
    max_attempts: int = Field(default=3, ge=1)
    # passive outlier ejection: this many consecutive 5xx answers or transport failures take an
    # instance out of rotation for outlier_ejection_s (doubling on each ejection in a row, up to
    # outlier_max_ejection_s); the first successful health probe after that re-admits it. At most
    # outlier_max_ejected_fraction of a role's instances are ejected at once.
    outlier_consecutive_errors: int = Field(default=5, ge=1)
    outlier_ejection_s: float = 10.0
    outlier_max_ejection_s: float = 300.0
    outlier_max_ejected_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    # kv_transfer_params (and SGLang's bootstrap_* fields) in a client's body steer where a worker
    # connects: dropped unless the operator trusts the clients (e.g. another router in front)
    trust_client_kv_transfer_params: bool = False

    health_interval_s: float = 5.0
    # an instance out of rotation (not answered yet, failed its probes, or ejected) is probed this
    # often instead, so one that comes up (a vLLM engine still loading when the gateway started) or
    # recovers is back within about this long rather than a whole health_interval_s (Envoy's
    # unhealthy_interval); never less often than health_interval_s
    health_unhealthy_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2  # consecutive failed probes
    min_ready_prefill: int = 1
    min_ready_decode: int = 1

    # several gateway replicas in front of the same workers share their in-flight load here
    load_share: Literal["none", "redis"] = "none"
    redis_url: str = "redis://127.0.0.1:6379/0"
    replica_id: str | None = None  # defaults to host name and process id
    load_sync_interval_s: float = 0.1
    # a decision first fetches the other replicas' load when the last exchange is older than this
    # (one Redis round trip, shared by the requests arriving meanwhile); None: decide on the view
    # the last beat or dispatch brought, up to load_sync_interval_s old
    load_sync_max_age_s: float | None = Field(0.005, ge=0)
    # each exchange with Redis gives up after load_share_timeout_s; after load_share_breaker_failures
    # in a row none is tried for load_share_breaker_open_s, and replicas route on their own load
    load_share_timeout_s: float = Field(0.2, gt=0)
    load_share_breaker_failures: int = Field(3, gt=0)
    load_share_breaker_open_s: float = Field(1.0, gt=0)

    block_size: int = 16  # tokens per KV block: must equal the workers' --block-size
    # KV-cache awareness: tokenizer, block keys, the cache index and its feeds (conductor/kv/analyzer.py).
    # Its block size is the one above; its KV event endpoints default to each instance's kv_events_endpoint.
    kv: KVAwarenessSettings = KVAwarenessSettings()
    max_connections_per_upstream: int = 256
    # requests in flight at once through this gateway; past it new ones get 503 at once instead of
    # queueing without bound in front of the workers
    max_inflight_requests: int = 4096
    # every this many seconds: one full garbage collection, then everything that survived is frozen
    # out of later ones (conductor/ops/gc_freeze.py: a big KV index otherwise makes each full pass a
    # tens-of-milliseconds stall in the p99); None: Python's default collector alone
    gc_freeze_interval_s: float | None = Field(default=60.0, gt=0)

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
        if self.pd_peer_pull == "on" and not (self.pd_protocol == "nixl" and self.kv.enabled and self.decode):
            raise ValueError(
                "pd_peer_pull 'on' needs --pd-protocol nixl, decode instances and kv.enabled "
                "(the staging request names the prefix by the gateway's token ids)"
            )
        if self.pd_protocol in ("mooncake", "sglang"):
            missing = [p.url for p in self.prefill if p.bootstrap_port is None]
            if missing:
                raise ValueError(f"--pd-protocol {self.pd_protocol} needs a bootstrap port for prefill {missing}")
            if self.discovery.prefill is not None and self.discovery.prefill.bootstrap_port is None:
                raise ValueError(f"--pd-protocol {self.pd_protocol} needs discovery.prefill.bootstrap_port")
        return self

    def client_keys(self) -> frozenset[str]:
        """Every accepted client key: `api_keys` plus the lines of `api_keys_file`."""
        keys = {k.get_secret_value() for k in self.api_keys}
        if self.api_keys_file:
            keys |= set(_secret_lines(self.api_keys_file))
        return frozenset(keys)

    def admin_keys(self) -> frozenset[str]:
        """Every accepted admin key: `admin_api_keys` plus the lines of `admin_api_keys_file`."""
        keys = {k.get_secret_value() for k in self.admin_api_keys}
        if self.admin_api_keys_file:
            keys |= set(_secret_lines(self.admin_api_keys_file))
        return frozenset(keys)

    def upstream_key(self) -> str | None:
        if self.upstream_api_key_file:
            lines = _secret_lines(self.upstream_api_key_file)
            return lines[0] if lines else None
        return self.upstream_api_key.get_secret_value() if self.upstream_api_key else None

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


def _secret_lines(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from exc
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            merged[k] = _merge(dict(merged[k]), v)
        else:
            merged[k] = v
    return merged


def _with_roles(data: dict[str, Any]) -> dict[str, Any]:
    """Let YAML and env say `prefill: [http://a:8100]` or `[{url: ..., bootstrap_port: ...}]`."""
    for role in ("prefill", "decode", "mixed"):
        if role in data and data[role] is not None:
            items = data[role] if isinstance(data[role], list | tuple) else [data[role]]
            data[role] = [{"url": it, "role": role} if isinstance(it, str) else {"role": role, **it} for it in items]
    return data


def _url_key(url: Any) -> str:
    return str(url).rstrip("/")


def _merge_instances(data: Mapping[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """`flags` with each role's instance list merged into `data`'s by URL (see the module docstring).
    Both are already in `_with_roles` form: lists of dicts with url and role."""
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
    """Build the settings object; any problem is a ConfigError that names the field."""
    data: dict[str, Any] = {}
    if config_file is not None:
        try:
            loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {config_file} must hold a mapping at the top level")
        data = _with_roles(loaded)
    try:
        env = env_values(Settings, os.environ if environ is None else environ, ENV_PREFIX, _PLAIN_LISTS)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    data = _merge(data, _with_roles(env))
    if overrides:
        flags = _with_roles({k: v for k, v in overrides.items() if v is not None})
        data = _merge(data, _merge_instances(data, flags))
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from exc
