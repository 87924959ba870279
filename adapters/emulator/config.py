"""The emulator's settings: one frozen value built from the command line (or by tests)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from adapters.emulator.lora import LoraModule
from adapters.emulator.protocols import PdProtocol, Role


def _engine_id() -> str:
    return str(uuid.uuid4())


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Everything one emulated vLLM instance needs to know."""

    role: Role = Role.MIXED
    pd_protocol: PdProtocol = PdProtocol.NIXL
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "emulated"
    block_size: int = 16
    bootstrap_port: int | None = None  # prefill's bootstrap server (mooncake / sglang); None: none
    kv_events_endpoint: str | None = None  # ZMQ PUB endpoint, e.g. tcp://*:5557; None: no events
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER endpoint for replays
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000  # replay buffer, in batches
    kv_events_delay_s: float = 0.0  # each batch published this long after its step (a loaded engine's lag)
    profile_path: str | None = None  # YAML/JSON profile; None: the bundled default
    time_scale: float = 1.0  # every modelled duration is multiplied by this
    noise: float = 0.0  # sigma of the multiplicative lognormal noise (0: deterministic)
    seed: int | None = None  # seeds the noise
    kv_capacity_tokens: int = 1_000_000  # prefix cache capacity
    hash_algo: str = "sha256"  # vLLM's --prefix-caching-hash-algo (its default is sha256)
    hash_seed: str | None = None  # NONE_HASH seed; None: PYTHONHASHSEED, else vLLM's default rule
    engine_id: str = field(default_factory=_engine_id)
    max_model_len: int = 131_072
    default_max_tokens: int = 16  # when the request names none (vLLM: 16 for completions)
    embedding_size: int = 256  # components of a /v1/embeddings vector (the emulated hidden size)
    max_num_seqs: int | None = None  # overrides the profile's running batch limit
    # timing effects the predictors' formula lacks (effects.py); the defaults turn them off
    max_num_batched_tokens: int | None = None  # chunked prefill's token budget a step; None: no chunking
    mixed_batch_overhead: float = 0.0  # decodes in a step with a prefill chunk cost (1 + this) x
    kv_pressure_threshold: float = 0.9  # KV usage where steps start to slow down
    kv_pressure_slowdown: float = 0.0  # extra fraction of a step's time at a full KV cache
    request_log_size: int = 256  # bodies and headers kept for GET /emulator/requests
    cancelled_log_size: int = 1024  # request ids kept for GET /emulator/cancelled
    max_body_bytes: int = 64 << 20
    side_channel_port: int = 5600  # NIXL side channel advertised in kv_transfer_params (VLLM_NIXL_SIDE_CHANNEL_PORT)
    remote_wait_s: float = 120.0  # how long a decode leg waits for its prefill before prefilling locally
    otlp_traces_endpoint: str | None = None  # vLLM's --otlp-traces-endpoint: spans joined to the caller's trace
    # NixlConnector's kv_connector_extra_config (vLLM 0.32): decode -> prefill readback for multi-turn
    bidirectional_kv_xfer: bool = False
    kv_recompute_threshold: int = 64  # a prefill pulls only this many tokens or more
    decoder_kv_blocks_ttl: float = 480.0  # seconds a decode keeps an unread finished request's KV
    kv_lease_duration: float = 30.0  # seconds a prefill keeps a P/D request's KV for its reader
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: "fcfs" or "priority"
    lora_modules: tuple[LoraModule, ...] = ()  # vLLM's --lora-modules: adapters loaded at start (lora.py)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter served (so does VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False

    @property
    def serves_readback(self) -> bool:
        """An engine whose pinned KV others read on its side channel port: a bidirectional decode
        (its finished requests', read back by the next turn's prefill) or a bidirectional prefill
        (its NIXL prefill legs', read by another prefill: a prefill-to-prefill pull; a decode reads
        them too in emulation only by their content ids, then frees them)."""
        return self.bidirectional_kv_xfer and self.role is not Role.MIXED and self.pd_protocol is PdProtocol.NIXL

    @property
    def pin_ttl_s(self) -> float:
        """How long pinned KV waits for its reader: vLLM's decoder_kv_blocks_ttl on a decode, the
        kv_lease_duration (never renewed here: only a decode's heartbeats renew it) on a prefill."""
        return self.decoder_kv_blocks_ttl if self.role is Role.DECODE else self.kv_lease_duration

    @property
    def pulls_readback(self) -> bool:
        return self.bidirectional_kv_xfer and self.role is Role.PREFILL and self.pd_protocol is PdProtocol.NIXL

    @property
    def advertised_host(self) -> str:
        """The host other instances reach this one at (a wildcard bind advertises loopback)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
