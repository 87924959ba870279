"""Lessons: what one process's predictors learned, in a form another process's can learn from.

`conductor serve --workers N` runs N gateway processes on one port, each with its own policy and
its own `Predictors`. Their in-flight load is shared (adapters/shm_load_share.py), but what each
*learns* is not: each refits its models on the outcomes of the requests it dispatched itself, 1/N
of them, and calibrates its admission bounds on 1/N of the actual/predicted ratios. Over a short run
its bounds are then wider and admission turns more requests away: with two processes, 0.90x the
goodput of one (benchmarks/bench_replicas.py --compare workers, docs/performance.md).

Gateway replicas sharing load through Redis (`load_share.mode: redis`) are in the same position,
each learning from a third of the outcomes with three of them: their lessons travel through a Redis
stream (adapters/redis_lesson_share.py), the worker processes' through Unix datagram sockets
(adapters/lesson_share.py).

A lesson is one sample a model learned from: the features the model is fitted on and the measured
seconds. `Predictors.record_lessons` makes a process keep what its models learn from its own
observations; a sibling hands each one to its own `Predictors.learn`, which learns it as if it had
observed it, so every process fits its models on every outcome.

What is not a lesson: the actual/predicted ratios behind the calibrated bounds (predictors.quantile)
and the per-instance error windows. A ratio measures the model that made the prediction, and a
process clears its ratio windows when a refit moves its model (a new `generation`): a sibling's
ratios come from the sibling's model, refitted at other moments, and would refill the cleared
windows with errors of a model this process no longer uses, the very mix the generations keep out.
Each process calibrates its bounds on its own requests' outcomes; the error windows are diagnostics
each process exports for itself. (Measured before leaving ratios out: `bench_replicas.py --compare
workers`, two runs each, goodput of --workers 2 over one process 0.879 / 0.825 sharing ratios too,
0.855 / 0.906 sharing nothing: within the runs' spread.)

A lesson arrives from another process, so `checked` validates it entirely before it is learned:
its kind, arity and field types, finite numbers within bounds, short names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final, Protocol

Lesson = tuple[str | int | float, ...]

# kind -> the type of each field after the kind (int fields take ints, float fields ints or floats)
FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "prefill": (int, int, float),  # new tokens, cached tokens, seconds of the prefill's own compute
    "leg": (float, float, float, float),  # prefill features of a queue plus its request, seconds
    # a mixed worker's leg: its 7 features (params.mixed_leg_features), seconds
    "mixed_leg": (float, float, float, float, float, float, float, float),
    "decode_leg": (int, float, float),  # handoff tokens, TBT predicted, seconds of the decode leg
    "tbt": (int, int, float),  # batch, resident KV tokens, mean seconds between tokens
    "transfer": (str, float, float),  # link class, bytes, seconds
}
MAX_NAME = 64  # link classes are short identifiers
MAX_VALUE = 1e15  # tokens, bytes and seconds alike stay far below this


def checked(raw: object) -> Lesson:
    """`raw` as a lesson, or ValueError saying what is wrong with it."""
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError("a lesson is a non-empty list")
    kind = raw[0]
    types = FIELDS.get(kind) if isinstance(kind, str) else None
    if types is None:
        raise ValueError(f"unknown lesson kind {str(kind)[:32]!r}")
    if len(raw) != len(types) + 1:
        raise ValueError(f"a {kind} lesson has {len(types)} fields, not {len(raw) - 1}")
    out: list[str | int | float] = [kind]
    for value, want in zip(raw[1:], types, strict=True):
        if want is str:
            if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not value.isprintable():
                raise ValueError(f"{kind}: a name must be 1-{MAX_NAME} printable characters")
            out.append(value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and not isinstance(value, int)):
            raise ValueError(f"{kind}: expected {want.__name__}, got {type(value).__name__}")
        if not math.isfinite(value) or abs(value) > MAX_VALUE:
            raise ValueError(f"{kind}: {value!r} is not a finite number within {MAX_VALUE:g}")
        out.append(float(value) if want is float else value)
    return tuple(out)


class Learner(Protocol):
    """What a lesson is taught to (predictors.online.Predictors)."""

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None: ...
    def observe_leg(self, features: Sequence[float], seconds: float) -> None: ...
    def observe_mixed_leg(self, features: Sequence[float], seconds: float) -> None: ...
    def observe_decode_leg(self, handoff_tokens: int, tbt_s: float, seconds: float) -> None: ...
    def observe_tbt(self, batch: int, resident_kv_tokens: int, seconds: float) -> None: ...
    def observe_transfer(self, link: str, nbytes: float, seconds: float) -> None: ...


def teach(learner: Learner, lesson: Lesson) -> None:
    """Hand a `checked` lesson to the observation it records."""
    kind, *args = lesson
    if kind == "prefill":
        learner.observe_prefill(int(args[0]), int(args[1]), float(args[2]))
    elif kind == "leg":
        learner.observe_leg((float(args[0]), float(args[1]), float(args[2])), float(args[3]))
    elif kind == "mixed_leg":
        learner.observe_mixed_leg(tuple(float(a) for a in args[:7]), float(args[7]))
    elif kind == "decode_leg":
        learner.observe_decode_leg(int(args[0]), float(args[1]), float(args[2]))
    elif kind == "tbt":
        learner.observe_tbt(int(args[0]), int(args[1]), float(args[2]))
    else:  # "transfer"
        learner.observe_transfer(str(args[0]), float(args[1]), float(args[2]))
