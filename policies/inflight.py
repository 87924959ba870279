"""Prefixes on their way into a cache: what a policy has just sent to a prefill instance.

A KV index learns of a prefix when the worker has computed it (vLLM's KV events, the simulator's
cache on completion). Between dispatch and that moment the index is blind, and that is exactly
when the requests that share the prefix arrive: the parallel calls of an agent's tool step, the
next step of a loop whose queue was long, a burst of chats over one system prompt. Sent elsewhere,
each of them recomputes the prefix; sent behind it on the same FCFS instance, each finds it cached
when its turn comes. So a policy remembers its own dispatches here and counts a prefix in flight
on an instance as that instance's own: it can be reused there (the queue ahead finishes first),
never pulled from there yet.

Bounded: at most `max_keys` block keys; the oldest dispatches are forgotten first. A dispatch is
also forgotten when its request is observed: by then the index reports what the worker holds.
The default 200,000 keys (3.2M prompt tokens in flight at 16-token blocks) take about 20 MB:
10.6 MB of table under tracemalloc, plus the prompts' key tuples it keeps alive.
"""

from __future__ import annotations

from collections import OrderedDict


class InflightPrefixes:
    """Chained block keys of dispatched prompts -> the prefill instance computing them.

    Every dispatch files its whole key chain and a key maps to its newest dispatch, while
    forgetting goes oldest first. A key whose dispatch is forgotten is therefore one no newer
    dispatch shares, so the keys present for any prompt always form a prefix of its chain and the
    longest one is found by bisection."""

    __slots__ = ("_by_key", "_dispatches", "_keys", "_next", "max_keys")

    def __init__(self, max_keys: int = 200_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, not {max_keys!r}")
        self.max_keys = max_keys
        self._by_key: dict[int, tuple[int, str]] = {}  # key -> (dispatch number, instance id)
        self._dispatches: OrderedDict[str, tuple[int, tuple[int, ...]]] = OrderedDict()  # request -> (number, keys)
        self._keys = 0  # keys filed by the dispatches remembered
        self._next = 0

    def __len__(self) -> int:
        return len(self._dispatches)

    def add(self, request_id: str, block_keys: tuple[int, ...], instance_id: str) -> None:
        """`request_id` was sent to `instance_id`, which will compute (or reuse) `block_keys`."""
        if not block_keys:
            return
        self.forget(request_id)
        if len(block_keys) > self.max_keys:  # a tail alone would break the prefix property
            return
        keys = block_keys
        self._next += 1
        number = self._next
        self._dispatches[request_id] = (number, keys)
        self._keys += len(keys)
        entry = (number, instance_id)
        by_key = self._by_key
        for key in keys:
            by_key[key] = entry
        while self._keys > self.max_keys:
            oldest = next(iter(self._dispatches))
            self.forget(oldest)

    def forget(self, request_id: str) -> None:
        """The dispatch is done with (observed, failed): its keys go unless a newer one shares them."""
        found = self._dispatches.pop(request_id, None)
        if found is None:
            return
        number, keys = found
        self._keys -= len(keys)
        by_key = self._by_key
        for key in keys:
            entry = by_key.get(key)
            if entry is not None and entry[0] == number:
                del by_key[key]

    def longest(self, block_keys: tuple[int, ...]) -> tuple[str, int] | None:
        """(instance, leading blocks) of the longest in-flight prefix of `block_keys`, or None."""
        by_key = self._by_key
        if not block_keys or block_keys[0] not in by_key:
            return None
        lo, hi = 1, len(block_keys)  # keys[:lo] are present; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_keys[mid - 1] in by_key:
                lo = mid
            else:
                hi = mid - 1
        return by_key[block_keys[lo - 1]][1], lo
