"""The P/D handshakes as the real workers speak them, field names in one place.

Names are vLLM main's (2026) and SGLang's:

- NixlConnector (`nixl/*scheduler.py`, `request_finished`): the prefill request carries
  `kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_*: null}` and
  max_tokens 1; its answer's top-level `kv_transfer_params` is `{do_remote_prefill: true,
  do_remote_decode: false, remote_block_ids: [[...]] (one list per KV cache group), remote_engine_id,
  remote_request_id, remote_host, remote_port, tp_size, remote_num_tokens}`, handed verbatim to the
  decode request. The decode pulls when `do_remote_prefill` and `remote_block_ids` are set.
- MooncakeConnector (`mooncake/mooncake_connector.py`): both legs run concurrently and share a
  `transfer_id`; prefill `{do_remote_decode: true, do_remote_prefill: false, transfer_id}` answers
  `kv_transfer_params: null`; decode `{do_remote_decode: false, do_remote_prefill: true,
  remote_engine_id, remote_bootstrap_addr ("http://host:port"), transfer_id}`. The prefill engine's
  bootstrap server answers `GET /query` with `{dp_rank: {engine_id, worker_addr: {tp: {pp: addr}}}}`.
- SGLang: the same body to both legs plus `bootstrap_host`, `bootstrap_port`, `bootstrap_room`.

Emulator coordination (not part of any real protocol): the decode leg long-polls
`GET http://<prefill bootstrap>/emulator/transfer/<key>` until that prefill is done; the key is the
Mooncake `transfer_id`, or `sglang-<bootstrap_room>`. The NIXL prefill's `remote_block_ids` are
content ids (kv_content.py), so the decode knows which prompt's KV it pulls.

Batches (a completions `prompt` list): vLLM runs one engine request per prompt, each with the
request's kv_transfer_params. So in a batched NIXL prefill each prompt's KV has its own params (own
sub-request id `{id}-{i}`, own block ids) but the answer carries only the FIRST prompt's
(`final_res_batch[0].kv_transfer_params`), and a batched
decode given one set of params pulls that one KV for every prompt. A batched Mooncake / SGLang
prefill shares one transfer key among its prompts: the emulator lets the first prompt own the key
(`LegPlan.publish_key` is used by sub-request 0 only), so a batched decode waiting on the key gets
the first prompt's KV for every prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from adapters.emulator.kv_content import content_block_ids, seed_from_block_ids
from conductor.core.types import Role


class PdProtocol(StrEnum):
    NIXL = "nixl"
    MOONCAKE = "mooncake"
    SGLANG = "sglang"


@dataclass(frozen=True, slots=True)
class KvTransferFields:
    """vLLM main's kv_transfer_params keys (the one place they are spelled)."""

    do_remote_decode: str = "do_remote_decode"
    do_remote_prefill: str = "do_remote_prefill"
    remote_engine_id: str = "remote_engine_id"
    remote_block_ids: str = "remote_block_ids"
    remote_request_id: str = "remote_request_id"
    remote_host: str = "remote_host"
    remote_port: str = "remote_port"
    tp_size: str = "tp_size"
    remote_num_tokens: str = "remote_num_tokens"
    transfer_id: str = "transfer_id"
    remote_bootstrap_addr: str = "remote_bootstrap_addr"
    bootstrap_host: str = "bootstrap_host"
    bootstrap_port: str = "bootstrap_port"
    bootstrap_room: str = "bootstrap_room"


FIELDS = KvTransferFields()


@dataclass(frozen=True, slots=True)
class LegPlan:
    """What one incoming request is, P/D-wise.

    `wait_url`: the decode leg must wait on this URL (the prefill's bootstrap server) before its KV
    arrives; `remote_ready`: the decode leg's KV is already waiting remotely (NIXL, prefill done);
    `publish_key`: a prefill leg announces its completion under this key; `nixl_prefill`: answer
    with NIXL's kv_transfer_params; `remote_seed`: a NIXL decode's KV source (the content seed named
    by its `remote_block_ids`).
    """

    wait_url: str | None = None
    remote_ready: bool = False
    remote_seed: int | None = None
    publish_key: str | None = None
    nixl_prefill: bool = False
    force_one_token: bool = False

    @property
    def remote_decode(self) -> bool:
        return self.wait_url is not None or self.remote_ready


def _params(body: Mapping[str, Any]) -> Mapping[str, Any]:
    p = body.get("kv_transfer_params")
    return p if isinstance(p, Mapping) else {}


def transfer_url(base: str, key: str) -> str:
    return f"{base.rstrip('/')}/emulator/transfer/{key}"


def plan_leg(role: Role, protocol: PdProtocol, body: Mapping[str, Any]) -> LegPlan:
    """Classify a request by role, protocol and the fields it carries (mixed: always plain)."""
    f = FIELDS
    if role is Role.MIXED:
        return LegPlan()
    if protocol is PdProtocol.SGLANG:
        room = body.get(f.bootstrap_room)
        host, port = body.get(f.bootstrap_host), body.get(f.bootstrap_port)
        if room is None:
            return LegPlan()
        key = f"sglang-{room}"
        if role is Role.PREFILL:
            return LegPlan(publish_key=key, force_one_token=True)
        if host and port:
            return LegPlan(wait_url=transfer_url(f"http://{host}:{port}", key))
        return LegPlan()
    params = _params(body)
    if protocol is PdProtocol.MOONCAKE:
        transfer_id = params.get(f.transfer_id)
        if not transfer_id:
            return LegPlan()
        if role is Role.PREFILL and params.get(f.do_remote_decode):
            return LegPlan(publish_key=str(transfer_id), force_one_token=True)
        addr = params.get(f.remote_bootstrap_addr)
        if role is Role.DECODE and params.get(f.do_remote_prefill) and addr and params.get(f.remote_engine_id):
            return LegPlan(wait_url=transfer_url(str(addr), str(transfer_id)))
        return LegPlan()
    # NIXL
    if role is Role.PREFILL and params.get(f.do_remote_decode):
        return LegPlan(nixl_prefill=True, force_one_token=True)
    if role is Role.DECODE and params.get(f.do_remote_prefill) and params.get(f.remote_block_ids):
        needed = (f.remote_engine_id, f.remote_request_id, f.remote_host, f.remote_port)
        if all(params.get(k) is not None for k in needed):
            return LegPlan(remote_ready=True, remote_seed=seed_from_block_ids(params.get(f.remote_block_ids)))
    return LegPlan()


class NixlAnswer:
    """Builds the prefill answer's kv_transfer_params.

    Block ids are content ids of the prompt's blocks (kv_content.py) rather than slots of a real
    pool: the emulated decode reads the source prompt from them, as a real decode reads its KV.
    """

    def __init__(self, engine_id: str, host: str, side_channel_port: int, block_size: int) -> None:
        self.engine_id = engine_id
        self.host = host
        self.port = side_channel_port
        self.block_size = block_size

    def params(self, request_id: str, prompt: list[int]) -> dict[str, Any]:
        f = FIELDS
        return {
            f.do_remote_prefill: True,
            f.do_remote_decode: False,
            f.remote_block_ids: [content_block_ids(prompt, self.block_size)],
            f.remote_engine_id: self.engine_id,
            f.remote_request_id: request_id,
            f.remote_host: self.host,
            f.remote_port: self.port,
            f.tp_size: 1,
            f.remote_num_tokens: len(prompt),
        }
