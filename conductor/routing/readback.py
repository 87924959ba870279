"""Decode-to-prefill readback: the next turn's prefill pulls its prefix from the decode that served the last.

vLLM's NixlConnector with `bidirectional_kv_xfer` (vLLM 0.32; PR 32553) keeps a finished request's
KV blocks pinned on the decode for `decoder_kv_blocks_ttl` seconds (480 by default) and says where
they are in the `kv_transfer_params` of its (non-streamed) answer: `do_remote_decode: true`, the
request's block ids from position 0, its engine id, request id and side channel. A prefill handed
those params (with its usual `do_remote_decode: true`) pulls `min(remote_num_tokens, prompt) -
locally cached` tokens of them over NIXL before computing the rest, then the decode frees them.
One read per handle: after it, or after the TTL, the blocks are gone.

A multi-turn conversation's next prompt starts with the last prompt (and answer), so its KV is
mostly on the decode that served the last turn, while the prefill that computed it may have
evicted it or be busy. This table remembers each handle under the gateway's block key of the last
full block of the prompt it served; a new prompt whose block keys reach one of those keys shares
that many blocks with it, token for token (the keys are a hash chain), and only those blocks are
offered to the policy as a pull source (`RequestView.pull_sources`). The gateway hands a prefill
the handle only when the policy's decision pulls from that decode.

Bounded: at most `max_handles` handles and `max_block_ids` block ids held, oldest evicted first;
handles older than `ttl_s` (set below the workers' decoder_kv_blocks_ttl) are never offered.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec


class DecodeKvParams(msgspec.Struct, forbid_unknown_fields=False):
    """The fields of a bidirectional NIXL decode's answer that a readback needs (types checked)."""

    do_remote_decode: bool
    remote_block_ids: list[list[int]]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_num_tokens: int
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True, slots=True)
class Handle:
    """KV blocks pinned on one decode instance for one finished request."""

    instance: str  # the decode instance that holds them
    block_ids: array[int]  # the request's block ids from position 0 (one KV cache group)
    prompt_blocks: int  # full blocks of the prompt it served: the most a later prompt can share
    engine_id: str
    request_id: str  # the worker's id of that request (not the gateway's)
    host: str
    port: int
    tp_size: int
    created_s: float

    def params(self, blocks: int, block_size: int) -> dict[str, Any]:
        """The prefill leg's kv_transfer_params (merged over the usual do_remote_decode ones) that
        pull this handle's first `blocks` blocks."""
        return {
            "remote_block_ids": [list(self.block_ids[:blocks])],
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "remote_num_tokens": blocks * block_size,
        }


def parse_decode_params(instance: str, params: Any, prompt_blocks: int, now_s: float) -> Handle | None:
    """A Handle from a decode answer's kv_transfer_params, None when they are not a usable readback
    offer (bidirectional off, a multi-group or multi-rank layout this table does not split, bad types)."""
    try:
        p = msgspec.convert(params, DecodeKvParams)
    except (msgspec.ValidationError, TypeError):
        return None
    if not p.do_remote_decode or len(p.remote_block_ids) != 1 or p.dcp_size != 1 or p.pp_size != 1:
        return None
    ids = p.remote_block_ids[0]
    blocks = min(prompt_blocks, len(ids))
    if blocks <= 0 or not 0 < p.remote_port < 65536 or any(i < 0 for i in ids[:blocks]):
        return None
    return Handle(
        instance,
        array("q", ids[:blocks]),
        blocks,
        p.remote_engine_id,
        p.remote_request_id,
        p.remote_host,
        p.remote_port,
        p.tp_size,
        now_s,
    )


@dataclass(frozen=True, slots=True)
class Offer:
    """A handle that a new prompt can use: its first `blocks` blocks are that prompt's."""

    key: int  # where the handle is filed (taking it needs the key)
    handle: Handle
    blocks: int


class ReadbackTable:
    """Handles by the block key of the last full prompt block they cover (see module doc)."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_handles: int = 100_000,
        max_block_ids: int = 4_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_handles = max_handles
        self.max_block_ids = max_block_ids
        self._clock = clock
        self._handles: OrderedDict[int, Handle] = OrderedDict()
        self._block_ids = 0
        self.recorded = 0
        self.taken = 0
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def block_ids_held(self) -> int:
        return self._block_ids

    def now(self) -> float:
        return self._clock()

    def record(self, prompt_keys: Sequence[int], handle: Handle) -> None:
        """File `handle` (for a prompt with these block keys) under its last covered block's key."""
        if handle.prompt_blocks > len(prompt_keys) or handle.prompt_blocks <= 0:
            return
        key = prompt_keys[handle.prompt_blocks - 1]
        old = self._handles.pop(key, None)
        if old is not None:  # the same prompt served again: the newer blocks live longer
            self._block_ids -= len(old.block_ids)
        self._handles[key] = handle
        self._block_ids += len(handle.block_ids)
        self.recorded += 1
        while self._handles and (len(self._handles) > self.max_handles or self._block_ids > self.max_block_ids):
            _, gone = self._handles.popitem(last=False)
            self._block_ids -= len(gone.block_ids)
            self.evicted += 1

    def offer(self, prompt_keys: Sequence[int], usable: Callable[[str], bool] | None = None) -> Offer | None:
        """The handle sharing the most leading blocks with a prompt (at most all but its last
        token's block), if one is alive and its decode `usable`."""
        if not self._handles:
            return None
        now = self._clock()
        handles = self._handles
        for i in range(len(prompt_keys) - 1, -1, -1):
            handle = handles.get(prompt_keys[i])
            if handle is None or handle.prompt_blocks != i + 1:  # a chain key names one prefix length
                continue
            if now - handle.created_s > self.ttl_s:
                self._drop(prompt_keys[i])
                self.expired += 1
                continue
            if usable is None or usable(handle.instance):
                return Offer(prompt_keys[i], handle, i + 1)
        return None

    def take(self, offer: Offer) -> Handle | None:
        """Remove an offered handle for use (a decode serves each handle's blocks once); None when
        another request took it meanwhile."""
        handle = self._handles.get(offer.key)
        if handle is not offer.handle:
            return None
        self._drop(offer.key)
        self.taken += 1
        return handle

    def forget_instance(self, instance: str) -> None:
        """A decode restarted or left: its pinned blocks went with it."""
        for key in [k for k, h in self._handles.items() if h.instance == instance]:
            self._drop(key)

    def _drop(self, key: int) -> None:
        gone = self._handles.pop(key, None)
        if gone is not None:
            self._block_ids -= len(gone.block_ids)


def pull_tokens_for(offer: Offer, prompt_tokens: int, block_size: int) -> int:
    """Tokens a prefill would hold after pulling `offer`: whole blocks, and never the prompt's last
    token (a prefill always computes it, as it does on a local cache hit)."""
    return min(offer.blocks, (prompt_tokens - 1) // block_size) * block_size


def pull_sources(offer: Offer | None, prompt_tokens: int, block_size: int) -> Mapping[str, int]:
    if offer is None:
        return {}
    tokens = pull_tokens_for(offer, prompt_tokens, block_size)
    return {offer.handle.instance: tokens} if tokens > 0 else {}
