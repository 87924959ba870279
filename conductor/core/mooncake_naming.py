"""How a Mooncake Store's objects are named and reached: the `kv.mooncake` settings.

Plain values shared by the settings (conductor/config/kv.py) and the store probe that uses them
(adapters/mooncake_store.py, whose module docstring explains the naming schemes); no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from conductor.core.errors import ConfigError

KEY_TEMPLATES = {
    "vllm": "{prefix_at}{model}@tp_rank:{tp_rank}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}@{hash}",
    "lmcache": "{model}@{world_size}@{worker_id}@{hash}@{dtype}",
}


@dataclass(frozen=True, slots=True)
class MooncakeStoreSettings:
    """How to reach the store and how engines name their objects in it.

    master: the master's RPC address (host:port). metadata_server: "P2PHANDSHAKE" or the HTTP
    metadata URL. local_hostname: this host as the transfer engine should advertise it.
    key_scheme / key_template: object naming (see module doc); template fields are the ones below.
    timeout_s: a probe slower than this counts as "nothing in the store" for that request.
    """

    master: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    local_buffer_bytes: int = 16 << 20
    key_scheme: Literal["vllm", "lmcache", "custom"] = "vllm"
    key_template: str | None = None
    model: str = ""
    cache_prefix: str = ""
    tp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0
    group: int = 0
    world_size: int = 1
    worker_id: int = 0
    dtype: str = "bfloat16"
    timeout_s: float = 0.05

    def template(self) -> str:
        if self.key_scheme == "custom":
            if not self.key_template or "{hash}" not in self.key_template:
                raise ConfigError("mooncake key_scheme 'custom' needs a key_template containing {hash}")
            return self.key_template
        return self.key_template or KEY_TEMPLATES[self.key_scheme]
