"""The gateway settings' groups, one per concern (`pd:`, `auth:`, `timeouts:`, `limits:`, `outlier:`,
`health:`, `load_share:`, `tracing:`, `logs:`), nested in `Settings` (conductor/config/settings.py).

Each used to be a run of flat top-level keys (`pd_readback_ttl_s`, `health_interval_s`, ...): those are
still read, moved here with a warning (conductor/config/legacy.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from conductor.core.errors import ConfigError


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PdSettings(_Model):
    """Prefill/decode disaggregation: the handshake and what the gateway may pull between workers."""

    protocol: Literal["nixl", "mooncake", "sglang"] = "nixl"
    # which generation of vLLM's MooncakeConnector field names to speak (adapters/pd/mooncake.py)
    mooncake_schema: str = "transfer_id"
    # Decode-to-prefill readback (conductor/routing/readback.py): NIXL decodes started with
    # kv_connector_extra_config {"bidirectional_kv_xfer": true} hand back where a finished request's
    # KV is pinned; the next turn's prefill may pull its shared prefix from there instead of
    # recomputing it. "auto": offered to the policy wherever decodes hand such KV back (NIXL only,
    # KV awareness on: block keys tell which prefix matches); "off": never. No other protocol has a
    # pull the gateway can drive, so there the policy is offered none.
    readback: Literal["auto", "off"] = "auto"
    # never offer a handle older than this: below the workers' decoder_kv_blocks_ttl (480 s by default)
    readback_ttl_s: float = Field(default=240.0, gt=0)
    readback_max_handles: int = Field(default=100_000, gt=0)
    # Prefill-to-prefill pulls (conductor/routing/peer_pull.py): a prefill that lacks a prefix another
    # prefill holds pulls it over NIXL after a one-token staging request on the holder pins its
    # blocks. Needs NIXL, KV awareness, the gateway's token ids being the workers' own (a model
    # tokenizer, kv.forward_token_ids) and every prefill started with bidirectional_kv_xfer.
    # "auto": on once a decode has handed back bidirectional kv_transfer_params (the cluster runs
    # bidirectional_kv_xfer); "on": from the start (the conditions checked at start-up); "off": never.
    peer_pull: Literal["auto", "on", "off"] = "auto"
    # the workers' kv_recompute_threshold: vLLM skips a pull of fewer tokens, so none is planned
    pull_min_tokens: int = Field(default=64, ge=0)
    # the prefills' kv_lease_duration: a staged prefix stays pinned this long for the reader, so no
    # pull is staged for a request predicted to reach its prefill later than half of it
    peer_pull_lease_s: float = Field(default=30.0, gt=0)
    # vLLM `priority` of staging requests, where the prefills run --scheduling-policy priority: set it
    # below the clients' (0), e.g. -1, and a staging request waits only for the prefill running on the
    # holder instead of its whole queue. None: sent without one, so it queues FCFS
    peer_pull_priority: int | None = None
    # kv_transfer_params (and SGLang's bootstrap_* fields) in a client's body steer where a worker
    # connects: dropped unless the operator trusts the clients (e.g. another router in front)
    trust_client_kv_transfer_params: bool = False


# a tenant's or a priority class's name: a metric label value and a log field, so plain
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class TenantSettings(_Model):
    """One tenant (`auth.tenants.<name>`): the client keys that are its own, its weight in the fair
    share of `limits.max_inflight_requests` (conductor/routing/shares.py) and the priority class of its
    requests that name none (`priority.classes`; None: `priority.default`)."""

    api_keys: tuple[SecretStr, ...] = ()
    api_keys_file: str | None = None  # more of its keys, one per line, like auth.api_keys_file
    weight: float = Field(default=1.0, gt=0)
    priority: Name | None = None

    def keys(self) -> frozenset[str]:
        keys = {k.get_secret_value() for k in self.api_keys}
        if self.api_keys_file:
            keys |= set(_secret_lines(self.api_keys_file))
        return frozenset(keys)


class AuthSettings(_Model):
    """Keys: never printed (SecretStr), and may come from files Kubernetes mounts from a Secret."""

    api_keys: tuple[SecretStr, ...] = ()  # if set, clients must send one as a Bearer token
    api_keys_file: str | None = None  # more keys, one per line ('#' lines and blank lines skipped)
    # the admin API (/admin/instances: conductor/fleet/membership.py) takes only these keys; with none it is off
    admin_api_keys: tuple[SecretStr, ...] = ()
    admin_api_keys_file: str | None = None  # more admin keys, one per line, like api_keys_file
    upstream_api_key: SecretStr | None = None  # sent to workers instead of the client's key
    upstream_api_key_file: str | None = None  # the upstream key from a file (its first line)
    # with client keys and no admin_port, /metrics, /openapi.json and /docs on the public port take a
    # key too (an admin key; a client key where no admin key is set): true leaves /metrics open, for a
    # Prometheus that scrapes without credentials (conductor/server/app.py)
    public_metrics: bool = False
    # tenant name -> its keys, weight and default priority class: a request sent with one of its keys
    # is that tenant's (fair share, conductor/routing/shares.py); `api_keys` stay accepted, tenantless
    tenants: Mapping[Name, TenantSettings] = Field(default_factory=dict)

    def client_keys(self) -> frozenset[str]:
        """Every accepted client key: `api_keys`, the lines of `api_keys_file` and every tenant's."""
        keys = {k.get_secret_value() for k in self.api_keys}
        if self.api_keys_file:
            keys |= set(_secret_lines(self.api_keys_file))
        return frozenset(keys | set(self.key_owners()))

    def key_owners(self) -> dict[str, str]:
        """key -> the tenant it belongs to; a key given to two tenants is a ConfigError (a key also in
        `api_keys` is its tenant's)."""
        owners: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            keys = tenant.keys()
            if not keys:
                raise ConfigError(f"auth.tenants.{name}: no keys; give it api_keys or an api_keys_file with lines")
            for key in keys:
                if owners.setdefault(key, name) != name:
                    raise ConfigError(f"auth.tenants: a key of {name!r} is also a key of {owners[key]!r}; give each its own")
        return owners

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


def _secret_lines(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from exc
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class TimeoutSettings(_Model):
    connect_s: float = 5.0
    request_s: float = 600.0  # whole request, from admission to its last byte: past it, 504
    read_s: float = 120.0  # longest silence from a worker before 504
    bootstrap_s: float = 5.0
    # on SIGTERM: stop accepting, let requests in flight finish for this long, then close them
    drain_grace_s: float = 30.0
    # how long a client's connection may sit idle between requests (and take to send a request's
    # head or go silent mid-body) before the gateway closes it. Longer than every common client's
    # and proxy's own idle expiry (httpx 5 s, aiohttp 15 s, nginx upstream 60 s): a client that
    # reuses a connection the server is closing at that moment loses its request ("server
    # disconnected"), which uvicorn's 5 s default makes routine under load. nginx's keepalive_timeout
    keep_alive_s: float = Field(default=75.0, gt=0)
    # a client's request body, from its head to its last byte: past it, 408 (a trickled body holds a
    # connection and a buffer; the keep-alive bound above only catches a body that goes silent)
    request_body_s: float = Field(default=60.0, gt=0)


class LimitSettings(_Model):
    max_body_bytes: int = 16 * 1024 * 1024
    # a request whose leg failed before any byte reached the client (connection refused, a worker's
    # 5xx) is decided again without that instance, up to this many attempts in all
    max_attempts: int = Field(default=3, ge=1)
    max_connections_per_upstream: int = 256
    # requests in flight at once through this gateway; past it new ones get 503 at once instead of
    # queueing without bound in front of the workers
    max_inflight_requests: int = 4096
    # the most tokens a prompt may have; a longer one is a 400 (context_length_exceeded) before it
    # is forwarded, or even tokenized when its length alone says so (conductor/kv/prompt_bounds.py).
    # None: the context length the workers report (max_model_len in /v1/models), 131072 if none does;
    # a value here caps that
    max_prompt_tokens: int | None = Field(default=None, gt=0)
    # what a worker's answer may bring (adapters/http1_conn.py): its head in bytes and header lines,
    # and a body read whole (a stream is relayed piece by piece, each piece bounded); past one, the
    # leg fails as a 502 and the connection is dropped
    max_upstream_head_bytes: int = Field(default=64 * 1024, gt=0)
    max_upstream_headers: int = Field(default=256, gt=0)
    max_upstream_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # client connections per server (public and admin apart): past it, 503 and close
    max_client_connections: int = Field(default=10_000, gt=0)
    # requests one connection may have parsed ahead of the one being answered: past it, 503 and close
    max_pipelined_requests: int = Field(default=32, gt=0)


class HoldSettings(_Model):
    """Requests refused only for their TBT wait at the gateway for streams to end, within their
    TTFT SLO, instead of a 429 at once (conductor/routing/waiting_room.py); at most `max_held` at once."""

    enabled: bool = True
    max_held: int = Field(default=256, ge=0)
    # the longest a request waits, whatever its TTFT SLO (a client's header may set any)
    max_wait_s: float = Field(default=10.0, gt=0)


class OutlierSettings(_Model):
    """Passive outlier ejection: this many consecutive 5xx answers or transport failures take an
    instance out of rotation for ejection_s (doubling on each ejection in a row, up to
    max_ejection_s); the first successful health probe after that re-admits it. At most
    max_ejected_fraction of a role's instances are ejected at once."""

    consecutive_errors: int = Field(default=5, ge=1)
    ejection_s: float = 10.0
    max_ejection_s: float = 300.0
    max_ejected_fraction: float = Field(default=0.5, ge=0.0, le=1.0)


class HealthSettings(_Model):
    interval_s: float = 5.0
    # an instance out of rotation (not answered yet, failed its probes, or ejected) is probed this
    # often instead, so one that comes up (a vLLM engine still loading when the gateway started) or
    # recovers is back within about this long rather than a whole interval_s (Envoy's
    # unhealthy_interval); never less often than interval_s
    unhealthy_interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = 2.0
    # each instance's /v1/models is read again this often (on a passing probe), so the LoRA adapters
    # loaded at run time join its model pool; a failed read keeps the last lists
    models_refresh_s: float = Field(default=30.0, gt=0)
    unhealthy_after: int = 2  # consecutive failed probes
    min_ready_prefill: int = 1
    min_ready_decode: int = 1
    # below this share of a role's instances available, route over every one of them that has ever
    # answered a probe instead of the few left (Envoy's panic threshold: a starved gateway host that
    # times out every probe at once must not 503 a whole round); 0: never (conductor/fleet/health.py)
    panic_threshold: float = Field(default=0.5, ge=0.0, le=1.0)


class LoadShareSettings(_Model):
    """Several gateway replicas in front of the same workers share their in-flight load here."""

    mode: Literal["none", "redis"] = "none"
    redis_url: str = "redis://127.0.0.1:6379/0"
    replica_id: str | None = None  # defaults to host name and process id
    sync_interval_s: float = 0.1
    # a decision first fetches the other replicas' load when the last exchange is older than this
    # (one Redis round trip, shared by the requests arriving meanwhile); None: decide on the view
    # the last beat or dispatch brought, up to sync_interval_s old
    sync_max_age_s: float | None = Field(default=0.005, ge=0)
    # replicas (mode redis) or the processes of `--workers N` decide in turn (a Redis lock, a flock:
    # adapters/decision_turn.py), each seeing every earlier dispatch as one gateway does; off by
    # default: it serializes decisions and costs CPU (--workers 2: ~10% per request at 32 in flight)
    turns: bool = False
    # each exchange with Redis gives up after timeout_s; after breaker_failures in a row none is
    # tried for breaker_open_s, and replicas route on their own load
    timeout_s: float = Field(default=0.2, gt=0)
    breaker_failures: int = Field(default=3, gt=0)
    breaker_open_s: float = Field(default=1.0, gt=0)


class TracingSettings(_Model):
    # OpenTelemetry traces over OTLP/HTTP (e.g. http://collector:4318/v1/traces); off when unset
    otlp_endpoint: str | None = None
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    service_name: str = "conductor"


class LogSettings(_Model):
    # "text" lines or one JSON object a line; an access log line per request (no prompt text)
    format: Literal["text", "json"] = "text"
    access_log: bool = False
    level: str = "info"
