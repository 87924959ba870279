"""Prefixes on their way into a cache, counted where they will be reused.

A KV index learns of a prefix when the worker has computed it (vLLM's KV events, the simulator's
cache on completion). Between dispatch and that moment the index is blind, and that is exactly
when the requests that share the prefix arrive: the parallel calls of an agent's tool step, the
next step of a loop whose queue was long, a burst of chats over one system prompt. Sent elsewhere,
each of them recomputes the prefix; sent behind it on the same FCFS instance, each finds it cached
when its turn comes. So a policy remembers its own dispatches here and counts a prefix in flight
on an instance as that instance's own: it can be reused there (the queue ahead finishes first),
never pulled from there yet.

Not every block key is filed: one every `stride_tokens` tokens of the prompt (every 16th key at
the gateway's 16-token blocks, every key at the traces' 512-token ones) and the prompt's last, so a
32K-token prompt costs 128 dictionary entries, not 2,048; a prefix is then credited to the last
filed key it reaches, at most `stride_tokens` short. Bounded: at most `max_keys` filed keys, the
oldest dispatches forgotten first; a dispatch is also forgotten when its request is observed, by
when the index reports what the worker holds. The default 200,000 keys take about 20 MB
(docs/kvcache_aware.md, "Prefixes").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from conductor.core.types import CachedPrefix, RequestView


class InflightPrefixes:
    """Chained block keys of dispatched prompts -> the prefill instance computing them.

    Every dispatch files the keys at its chain's stride positions (and its last), a key maps to
    its newest dispatch, and forgetting goes oldest first. A key whose dispatch is forgotten is
    therefore one no newer dispatch shares, so the stride positions present for any prompt always
    form a prefix of its chain: the deepest is found by bisection, then the few positions before
    the next stride point are looked at for a dispatch's last key."""

    __slots__ = ("_by_key", "_dispatches", "_instance", "_keys", "_next", "max_keys", "stride_tokens")

    def __init__(self, max_keys: int = 200_000, stride_tokens: int = 256) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, not {max_keys!r}")
        if stride_tokens < 1:
            raise ValueError(f"stride_tokens must be at least 1, not {stride_tokens!r}")
        self.max_keys = max_keys
        self.stride_tokens = stride_tokens
        # key -> dispatch number, number -> instance id: ints and strings only, so the garbage
        # collector leaves these dicts alone (a dict of tuples, traversed on every full
        # collection, made the p99 of a decision 1.5 ms at 150,000 keys)
        self._by_key: dict[int, int] = {}
        self._instance: dict[int, str] = {}
        # request -> (number, its prompt's keys, stride): the filed keys are recomputed when it is
        # forgotten rather than kept as a tuple of their own, which every young-generation
        # collection would walk (a 128K-token prompt's 512 keys) before finding it holds no object
        self._dispatches: OrderedDict[str, tuple[int, tuple[int, ...], int]] = OrderedDict()
        self._keys = 0  # keys filed by the dispatches remembered
        self._next = 0

    def __len__(self) -> int:
        return len(self._dispatches)

    def _stride(self, block_size: int) -> int:
        return max(1, self.stride_tokens // max(1, block_size))

    def add(self, request_id: str, block_keys: tuple[int, ...], instance_id: str, block_size: int = 16) -> None:
        """`request_id` was sent to `instance_id`, which will compute (or reuse) `block_keys`."""
        self.forget(request_id)
        if not block_keys:
            return
        stride = self._stride(block_size)
        filed = self._filed(block_keys, stride)
        if filed > self.max_keys:  # a tail alone would break the prefix property
            return
        self._next += 1
        number = self._next
        self._dispatches[request_id] = (number, block_keys, stride)
        self._instance[number] = instance_id
        self._keys += filed
        by_key = self._by_key
        # every key when a block is a stride or more (the traces' 512-token blocks): one C-level update
        by_key.update(dict.fromkeys(block_keys if stride == 1 else block_keys[stride - 1 :: stride], number))
        if len(block_keys) % stride:
            by_key[block_keys[-1]] = number
        while self._keys > self.max_keys:
            self.forget(next(iter(self._dispatches)))

    def forget(self, request_id: str) -> None:
        """The dispatch is done with (observed, failed): its keys go unless a newer one shares them."""
        found = self._dispatches.pop(request_id, None)
        if found is None:
            return
        number, block_keys, stride = found
        del self._instance[number]
        self._keys -= self._filed(block_keys, stride)
        by_key = self._by_key
        get = by_key.get
        # stride 1 files every key, the last among them: no slice and no tuple to build
        for key in block_keys if stride == 1 else (*block_keys[stride - 1 :: stride], block_keys[-1]):
            if get(key) == number:
                del by_key[key]

    @staticmethod
    def _filed(block_keys: tuple[int, ...], stride: int) -> int:
        """How many of a prompt's keys are filed: one per stride, and the last when it falls between."""
        return len(block_keys) // stride + (1 if len(block_keys) % stride else 0)

    def longest(self, block_keys: tuple[int, ...], block_size: int = 16) -> tuple[str, int] | None:
        """(instance, leading blocks) of the longest in-flight prefix of `block_keys`, or None."""
        by_key = self._by_key
        if not by_key or not block_keys:
            return None
        stride = self._stride(block_size)
        lo, hi = 0, len(block_keys) // stride  # stride points 1..lo are present; find the largest lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_keys[mid * stride - 1] in by_key:
                lo = mid
            else:
                hi = mid - 1
        # a dispatch whose prompt ends between this stride point and the next filed its last key there
        for blocks in range(min(len(block_keys), (lo + 1) * stride - 1), lo * stride, -1):
            number = by_key.get(block_keys[blocks - 1])
            if number is not None:
                return self._instance[number], blocks
        return None if lo == 0 else (self._instance[by_key[block_keys[lo * stride - 1]]], lo * stride)


def with_inflight(inflight: InflightPrefixes | None, request: RequestView) -> RequestView:
    """`request` with the longest prefix in flight counted as cached on its instance."""
    found = None if inflight is None else inflight.longest(request.block_keys, request.block_size)
    if found is None:
        return request
    instance, blocks = found
    tokens = min(blocks * request.block_size, request.prompt_tokens)
    own = request.cached.get(instance)
    if own is not None and own.tokens >= tokens:
        return request
    return replace(request, cached={**request.cached, instance: CachedPrefix(tokens)})
