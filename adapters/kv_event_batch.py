"""vLLM KV event batches: the typed events, their strict decoding, and slicing big ones.

Payload format (vLLM `vllm/distributed/kv_events.py`): an EventBatch, an array [ts, events,
data_parallel_rank] (a map with those names in some vLLM versions: both are accepted); each event
a msgpack map tagged by "type" (BlockStored, BlockRemoved, AllBlocksCleared), or in older versions
an array whose first element is that tag and the rest the fields in order. Block hashes are ints
(the low 64 bits of the digest) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, raw digests: those
are folded to the same low 64 bits here.

Decoding is strict because a batch is only trusted once it decodes: msgspec checks every field's
type (hashes and token ids non-negative ints, a digest at most 64 bytes) while it decodes, in C, and
a batch that does not check out raises `BadBatch` before anyone looks at its sequence number. An
event of a type this version does not know is skipped (vLLM may add some), not fatal.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

_LOW64 = (1 << 64) - 1


def as_event_id(h: int | bytes) -> int:
    """A block hash as the 64-bit int vLLM sends by default (raw digests folded to their low bits)."""
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(h, "big") & _LOW64
    return int(h) & _LOW64


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks a worker just cached (one request's new blocks, in chain order).

    block_hashes: vLLM's hash of each block (low 64 bits). parent_block_hash: hash of the block
    before the first one, None at the start of a prompt. token_ids: all blocks' tokens, concatenated.
    medium: "GPU" or "CPU" (offloaded), None means GPU. lora_name/extra_keys: what else went into
    vLLM's hash: the LoRA adapter (its name; every block's extra keys `[name]`), multimodal inputs,
    a cache salt (conductor/core/adapter_keys.py `event_adapter` tells them apart). lora_id: the
    adapter's number on that engine (deprecated in vLLM: `lora_name` names it).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks a worker evicted from `medium`."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache (reset, or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: when, what, and from which data-parallel rank."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


class BadBatch(ValueError):
    """A payload that is not a plausible EventBatch. reason: "undecodable" (not msgpack, or not an
    array/map of the right shape) or "invalid" (a field of the wrong type or out of range)."""

    def __init__(self, reason: Literal["undecodable", "invalid"], detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# ---- the wire structs: msgspec validates while it decodes ---------------------------------------
_Hash = Annotated[int, msgspec.Meta(ge=0)] | Annotated[bytes, msgspec.Meta(max_length=64)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class _StoredFields(msgspec.Struct):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: list[_Count] = []
    block_size: _Count = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: _Count | None = None


class _RemovedFields(msgspec.Struct):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: _Count | None = None


class _MapStored(_StoredFields, tag="BlockStored", tag_field="type"):
    pass


class _MapRemoved(_RemovedFields, tag="BlockRemoved", tag_field="type"):
    pass


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _ArrayStored(_StoredFields, tag="BlockStored", array_like=True):
    pass


class _ArrayRemoved(_RemovedFields, tag="BlockRemoved", array_like=True):
    pass


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


_MapEvent = _MapStored | _MapRemoved | _MapCleared
_ArrayEvent = _ArrayStored | _ArrayRemoved | _ArrayCleared
_WireEvent = _MapEvent | _ArrayEvent
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: _Count | None = None


class _MapBatch(msgspec.Struct):
    ts: float = 0.0
    events: msgspec.Raw = msgspec.Raw(b"\x90")  # an empty array
    data_parallel_rank: _Count | None = None


_array_batch = msgspec.msgpack.Decoder(_ArrayBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_map_events = msgspec.msgpack.Decoder(list[_MapEvent])
_array_events = msgspec.msgpack.Decoder(list[_ArrayEvent])
_raw_events = msgspec.msgpack.Decoder(list[msgspec.Raw])
_one_map_event = msgspec.msgpack.Decoder(_MapEvent)
_one_array_event = msgspec.msgpack.Decoder(_ArrayEvent)
_untyped = msgspec.msgpack.Decoder()


def _is_map(raw: bytes | memoryview) -> bool:
    """A msgpack map (fixmap, map16, map32) starts here."""
    return bool(raw) and (0x80 <= raw[0] <= 0x8F or raw[0] in (0xDE, 0xDF))


def decode_batch(payload: bytes) -> EventBatch:
    """Decode and check one msgpack EventBatch payload (array or map form); raises BadBatch."""
    try:
        wire = (_map_batch if _is_map(payload) else _array_batch).decode(payload)
    except msgspec.ValidationError as exc:
        raise BadBatch("invalid", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise BadBatch("undecodable", str(exc)) from None
    if not math.isfinite(wire.ts):
        raise BadBatch("invalid", f"timestamp {wire.ts}")
    events = tuple(_event(e) for e in _wire_events(wire.events))
    return EventBatch(ts=wire.ts, events=events, data_parallel_rank=wire.data_parallel_rank)


def _wire_events(raw: msgspec.Raw) -> list[_WireEvent]:
    # vLLM sends one form per batch: decode the whole list in one go, the slow way only for a batch
    # that mixes forms or holds an event type this version does not know
    for decoder in (_map_events, _array_events):
        try:
            return list(decoder.decode(raw))
        except msgspec.DecodeError:
            continue
    try:
        parts = _raw_events.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadBatch("undecodable", f"events: {exc}") from None
    return [e for e in (_one_event(p) for p in parts) if e is not None]


def _one_event(raw: msgspec.Raw) -> _WireEvent | None:
    """One event decoded on its own; None for a well-formed event of an unknown type."""
    try:
        return (_one_map_event if _is_map(memoryview(raw)) else _one_array_event).decode(raw)
    except msgspec.DecodeError as exc:
        error = exc
    value = _untyped.decode(raw)
    tag = value.get("type") if isinstance(value, dict) else (value[0] if isinstance(value, list) and value else None)
    if isinstance(tag, str) and tag not in _KNOWN_TAGS:
        return None  # a newer event type: ignored, not fatal
    raise BadBatch("invalid", f"event {tag!r}: {error}")


def _fold(hashes: list[int | bytes]) -> tuple[int, ...]:
    return tuple(h if type(h) is int else as_event_id(h) for h in hashes)


def _event(e: _WireEvent) -> KVEvent:
    if isinstance(e, _StoredFields):
        parent = e.parent_block_hash
        return BlockStored(
            block_hashes=_fold(e.block_hashes),
            parent_block_hash=None if parent is None else as_event_id(parent),
            token_ids=tuple(e.token_ids),
            block_size=e.block_size,
            medium=e.medium,
            lora_name=e.lora_name,
            extra_keys=None if e.extra_keys is None else tuple(e.extra_keys),
            group_idx=e.group_idx,
            lora_id=e.lora_id,
        )
    if isinstance(e, _RemovedFields):
        return BlockRemoved(_fold(e.block_hashes), e.medium, e.group_idx)
    return AllBlocksCleared()


# ---- slicing: a big batch is applied a bounded number of blocks at a time -----------------------
def batch_blocks(batch: EventBatch) -> int:
    """Blocks the batch stores or removes."""
    return sum(len(e.block_hashes) for e in batch.events if not isinstance(e, AllBlocksCleared))


def slice_batch(batch: EventBatch, max_blocks: int) -> Iterator[EventBatch]:
    """The batch as consecutive batches of at most `max_blocks` blocks each (an event may be cut in
    pieces), which applied in order leave the index exactly as the whole one would: a BlockStored
    piece names the last block of the piece before it as its parent, and carries its own blocks'
    tokens."""
    events: list[KVEvent] = []
    room = max_blocks
    for event in batch.events:
        for piece in _pieces(event, max_blocks):
            size = 0 if isinstance(piece, AllBlocksCleared) else len(piece.block_hashes)
            if events and size > room:
                yield EventBatch(batch.ts, tuple(events), batch.data_parallel_rank)
                events, room = [], max_blocks
            events.append(piece)
            room -= size
    if events:
        yield EventBatch(batch.ts, tuple(events), batch.data_parallel_rank)


def _pieces(event: KVEvent, max_blocks: int) -> Iterator[KVEvent]:
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= max_blocks:
        yield event
        return
    hashes = event.block_hashes
    for start in range(0, len(hashes), max_blocks):
        end = min(start + max_blocks, len(hashes))
        if isinstance(event, BlockRemoved):
            yield BlockRemoved(hashes[start:end], event.medium, event.group_idx)
            continue
        size = event.block_size
        yield BlockStored(
            block_hashes=hashes[start:end],
            parent_block_hash=event.parent_block_hash if start == 0 else hashes[start - 1],
            token_ids=event.token_ids[start * size : end * size] if size else event.token_ids,
            block_size=size,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,  # whole: whether the blocks are keyable stays the same
            group_idx=event.group_idx,
            lora_id=event.lora_id,
        )
