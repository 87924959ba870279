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

Bidirectional NIXL (vLLM 0.32, `kv_connector_extra_config.bidirectional_kv_xfer`; readback.py):
- A decode with it on pins every normally finished request's KV and answers a non-streamed request
  with `{do_remote_prefill: false, do_remote_decode: true, remote_block_ids: [[...]] (the sequence's
  blocks from position 0), remote_engine_id, remote_request_id, remote_host, remote_port, tp_size,
  dcp_size, pp_size, remote_num_tokens (prompt + generated - 1, the computed tokens),
  remote_blocks_expiry_time (the decode process's perf_counter() at expiry), transfer_mode: "pull"}`.
  A streamed answer carries none (its blocks are pinned all the same, until the TTL).
- The next turn's prefill request carries `{do_remote_decode: true, do_remote_prefill: false,
  remote_block_ids: [[first k]], remote_engine_id, remote_request_id, remote_host, remote_port,
  tp_size, remote_num_tokens: N}`. With all of remote_engine_id/request_id/host/port and block ids
  present, a bidirectional prefill pulls `min(N, prompt) - local hit` tokens when that is > 0 and
  >= kv_recompute_threshold, else nothing; either way the decode's pin is then released. Its own
  answer adds `remote_prefill_cached_tokens` (local hit + pulled).
- The wire (emulator-only, standing in for NIXL's side channel + RDMA read): the decode serves HTTP
  on its advertised side channel port (`remote_host:remote_port`, `--side-channel-port`), and the
  prefill calls `POST /emulator/kv/{remote_request_id}/read` with `{"engine_id", "first_block",
  "num_tokens"}`: 200 `{"block_ids": [...]}` (the content ids of the pinned sequence's blocks
  `first_block..` up to token `num_tokens`, the last one cut there; the pin is released: single
  use), or 404 when the pin is gone (expired, read, unknown) or 409 on an engine id mismatch, which
  the prefill treats as a KV load failure and recomputes. `num_tokens: 0` only releases the pin
  (NIXL's free notification when nothing is pulled). The block ids the request carries are not used
  as addresses: what is read is the pinned KV of `remote_request_id`, at the positions pulled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from adapters.emulator.kv_content import Taint, content_block_ids, held_block_ids, seed_from_block_ids
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
    dcp_size: str = "dcp_size"
    pp_size: str = "pp_size"
    remote_blocks_expiry_time: str = "remote_blocks_expiry_time"
    transfer_mode: str = "transfer_mode"
    remote_prefill_cached_tokens: str = "remote_prefill_cached_tokens"


FIELDS = KvTransferFields()


@dataclass(frozen=True, slots=True)
class ReadbackHandle:
    """A prefill request's pointer to a decode's pinned KV (bidirectional NIXL)."""

    request_id: str
    engine_id: str
    host: str
    port: int
    num_blocks: int  # len(remote_block_ids[-1]): the blocks the router lets it read
    num_tokens: int | None  # remote_num_tokens; None: as many as the blocks hold

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/emulator/kv/{self.request_id}/read"


def _readback(params: Mapping[str, Any]) -> ReadbackHandle | None:
    f = FIELDS
    ids = params.get(f.remote_block_ids)
    group = ids[-1] if isinstance(ids, list) and ids and isinstance(ids[-1], list) else ids
    engine, request, host, port = (params.get(k) for k in (f.remote_engine_id, f.remote_request_id, f.remote_host, f.remote_port))
    if not isinstance(group, list) or not group or None in (engine, request, host, port):
        return None
    tokens = params.get(f.remote_num_tokens)
    try:
        num_tokens = int(tokens) if tokens is not None else None
        return ReadbackHandle(str(request), str(engine), str(host), int(str(port)), len(group), num_tokens)
    except (TypeError, ValueError):  # a port or token count that is no number: no readback
        return None


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
    remote_block_ids: tuple[int, ...] | None = None  # a NIXL decode's ids (the last KV cache group)
    publish_key: str | None = None
    nixl_prefill: bool = False
    force_one_token: bool = False
    readback: ReadbackHandle | None = None  # a NIXL prefill may pull this engine's pinned KV (bidirectional)
    source: ReadbackHandle | None = None  # a NIXL decode's prefill: told to free its pin once the KV is here

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
        return LegPlan(nixl_prefill=True, force_one_token=True, readback=_readback(params))
    if role is Role.DECODE and params.get(f.do_remote_prefill) and params.get(f.remote_block_ids):
        needed = (f.remote_engine_id, f.remote_request_id, f.remote_host, f.remote_port)
        if all(params.get(k) is not None for k in needed):
            ids = params.get(f.remote_block_ids)
            group = ids[-1] if isinstance(ids, list) and ids and isinstance(ids[-1], list) else ids
            block_ids = tuple(group) if isinstance(group, list) and all(type(b) is int for b in group) else None
            return LegPlan(
                remote_ready=True, remote_seed=seed_from_block_ids(ids), remote_block_ids=block_ids, source=_readback(params)
            )
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

    def params(
        self, request_id: str, prompt: list[int], taint: Taint | None = None, cached_tokens: int | None = None
    ) -> dict[str, Any]:
        """A prefill's answer; `taint`: its KV is not all its prompt's (a wrong readback);
        `cached_tokens`: a bidirectional prefill reports its local hit + pulled tokens."""
        f = FIELDS
        ids = content_block_ids(prompt, self.block_size) if taint is None else held_block_ids(prompt, self.block_size, taint)
        out: dict[str, Any] = {
            f.do_remote_prefill: True,
            f.do_remote_decode: False,
            f.remote_block_ids: [ids],
            f.remote_engine_id: self.engine_id,
            f.remote_request_id: request_id,
            f.remote_host: self.host,
            f.remote_port: self.port,
            f.tp_size: 1,
            f.remote_num_tokens: len(prompt),
        }
        if cached_tokens is not None:
            out[f.remote_prefill_cached_tokens] = cached_tokens
        return out

    def decode_params(self, request_id: str, block_ids: list[int], num_tokens: int, expiry: float) -> dict[str, Any]:
        """A bidirectional decode's answer: where the next turn's prefill can read its KV back."""
        f = FIELDS
        return {
            f.do_remote_prefill: False,
            f.do_remote_decode: True,
            f.remote_block_ids: [block_ids],
            f.remote_engine_id: self.engine_id,
            f.remote_request_id: request_id,
            f.remote_host: self.host,
            f.remote_port: self.port,
            f.tp_size: 1,
            f.dcp_size: 1,
            f.pp_size: 1,
            f.remote_num_tokens: num_tokens,
            f.remote_blocks_expiry_time: expiry,
            f.transfer_mode: "pull",
        }
