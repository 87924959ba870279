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

_ID_BITS = 31
_ID_MASK = (1 << _ID_BITS) - 1
_PERSON = b"emu-kv-content"  # keeps these digests apart from any other blake2b use
_ITEM = array("I").itemsize  # bytes per packed token id


@dataclass(frozen=True, slots=True)
class RemoteKv:
    """The KV a decode leg received from a remote prefill.

    `seed`: the content seed of the prompt that KV was computed from; None when unknown, in which
    case the sequence is taken to have received its own prompt's KV.
    """

    seed: int | None = None


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
        h.update(data[start:start + step])
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
