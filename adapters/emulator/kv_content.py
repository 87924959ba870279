"""What the emulated KV holds: a content id per block, and the seed the generated text comes from.

A real decode computes its continuation from the KV it attends to, wherever that KV came from. The
emulator models that so a KV mix-up shows in the answer: the generated text is a deterministic
function of the *content seed* of the KV a sequence runs on (see `openai_format.word_index`).

- A sequence that prefills itself (mixed, prefill, or a decode falling back to a local prefill)
  runs on its own prompt's KV: seed = `content_seed(prompt)`.
- A NIXL decode runs on the blocks named by `remote_block_ids`. The emulated prefill makes those
  ids content-addressed (`content_block_ids`: id j identifies tokens[: (j + 1) * block_size], the
  last, partial block included), so the last id of the last group *is* the source prompt's content
  seed, and a decode handed another prompt's params continues that other prompt.
- A Mooncake / SGLang decode learns the seed from its prefill's bootstrap server
  (`TransferDone.kv_seed`), i.e. from the prefill that published under its transfer key.
- Bidirectional NIXL (readback.py): a decode's finished sequence is prompt + generated tokens;
  generated token k's id is `word_index(seed, k)` (the word it emitted, `generated_token_ids`), so a
  token-id client can build the next turn's prompt from it. Its block ids are the content ids of
  that sequence. A prefill that pulls blocks whose ids differ from its own prompt's ids at the same
  positions runs on that wrong KV: from the first differing block on, its KV is *tainted* (`Taint`),
  its block ids become derived ids, and its content seed is the last of them, so its text (and that
  of any decode reading its KV, or any later prefill reading that decode's) differs.

Ids are blake2b prefix digests cut to 31 bits (positive, int32-safe, like real block ids), so they
do not depend on the block hasher, its seed, or the order requests arrived in.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adapters.emulator.openai_format import word_index

_ID_BITS = 31
_ID_MASK = (1 << _ID_BITS) - 1
_PERSON = b"emu-kv-content"  # keeps these digests apart from any other blake2b use
_TAINT = b"emu-kv-taint"  # ids of blocks computed on wrong KV: never equal to a content id by design
_ITEM = array("I").itemsize  # bytes per packed token id


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """The KV a decode leg received from a remote prefill.

    `seed`: the content seed of the prompt that KV was computed from; None when unknown, in which
    case the sequence is taken to have received its own prompt's KV.
    """

    seed: int | None = None
    block_ids: tuple[int, ...] | None = None  # NIXL: the ids it was handed (one KV cache group)


@dataclass(frozen=True, slots=True)
class Taint:
    """KV that is not what the tokens say from block `first` on: garbage derived from `salt`."""

    first: int
    salt: int

    def apply(self, ids: list[int]) -> list[int]:
        """The ids of blocks holding this KV: content ids before `first`, derived ids after."""
        return ids[: self.first] + [_derived_id(self.salt, j) for j in range(self.first, len(ids))]


@dataclass(frozen=True, slots=True)
class PulledKv:
    """What a prefill read back from a decode (bidirectional NIXL): `tokens` pulled, and the KV's
    identity afterwards (`taint` None: the pulled blocks were this prompt's own; `seed`: the content
    seed the sequence then runs on)."""

    tokens: int
    taint: Taint | None
    seed: int


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("I", tokens)  # token ids are validated against the vocabulary: < 2**32
    if sys.byteorder == "big":  # the same ids on every host
        packed.byteswap()
    return packed.tobytes()


def _to_id(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") & _ID_MASK


def content_seed(prompt: Sequence[int]) -> int:
    """The content id of the whole prompt (equal to the last of `content_block_ids`)."""
    return _to_id(hashlib.blake2b(_token_bytes(prompt), digest_size=16, person=_PERSON).digest())


def content_block_ids(prompt: Sequence[int], block_size: int) -> list[int]:
    """One id per KV block of `prompt` (the partial last block too): the id of the prefix it ends."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    data = memoryview(_token_bytes(prompt))  # packed once: per-block packing costs 5x more
    step = _ITEM * block_size
    ids: list[int] = []
    for start in range(0, len(data), step):
        h.update(data[start : start + step])
        # a running prefix digest: each id needs the digest so far without ending the hash
        ids.append(_to_id(h.copy().digest()))
    return ids


def seed_from_block_ids(value: Any) -> int | None:
    """The source prompt's content seed from NIXL `remote_block_ids` (one list per KV cache group,
    or a flat list); None when there is no usable id."""
    if isinstance(value, list) and value and isinstance(value[-1], list):
        value = value[-1]
    if isinstance(value, list) and value:
        last = value[-1]
        if isinstance(last, int) and not isinstance(last, bool):
            return last
    return None


def _derived_id(salt: int, j: int) -> int:
    data = salt.to_bytes(8, "little") + j.to_bytes(8, "little")
    return _to_id(hashlib.blake2b(data, digest_size=16, person=_TAINT).digest())


def ids_digest(ids: Sequence[int]) -> int:
    """One id standing for a list of block ids (the salt of KV computed on top of them)."""
    packed = array("q", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return _to_id(hashlib.blake2b(packed.tobytes(), digest_size=16, person=_TAINT).digest())


def first_mismatch(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first index where two id lists differ (a length difference counts); None when equal."""
    for j, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return j
    return None if len(got) == len(want) else min(len(got), len(want))


def held_block_ids(tokens: Sequence[int], block_size: int, taint: Taint | None) -> list[int]:
    """The ids of the blocks a sequence holds for `tokens`, given what its KV really is."""
    ids = content_block_ids(tokens, block_size)
    return ids if taint is None else taint.apply(ids)


def received_taint(remote: RemoteKv, prompt: Sequence[int], block_size: int) -> Taint | None:
    """The taint of a decode's KV received from a prefill; None when it is this prompt's own."""
    if remote.seed is None or remote.seed == content_seed(prompt):
        return None
    first = 0
    if remote.block_ids is not None:
        first = first_mismatch(remote.block_ids, content_block_ids(prompt, block_size)) or 0
    return Taint(first, remote.seed)


def generated_token_ids(seed: int, n: int) -> list[int]:
    """The token ids of a sequence's first `n` generated tokens (the index of each emitted word)."""
    return [word_index(seed, k) for k in range(n)]
