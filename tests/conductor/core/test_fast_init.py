"""conductor.core.fast_init: the replaced __init__ builds the objects the dataclass would."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import InitVar, dataclass, field
from typing import Any

import pytest

from conductor.core import types
from conductor.core.fast_init import fast_init
from policies import estimate


def _example() -> Any:
    """A fresh class of every kind of field: positional, defaulted, factory, not in __init__,
    keyword-only. Called twice, for the class as the dataclass makes it and for fast_init's."""

    @dataclass(frozen=True, slots=True)
    class Example:
        a: int
        b: str = "b"
        c: tuple[int, ...] = field(default_factory=lambda: (1, 2))
        d: int = field(default=7, init=False)
        e: tuple[int, ...] = field(default_factory=tuple, kw_only=True)

    return Example


Plain = _example()
Fast = fast_init(_example())


def _state(obj: object) -> tuple[object, ...]:
    return tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))  # type: ignore[arg-type]


def test_same_fields_defaults_and_factories_as_the_generated_init() -> None:
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}),
        ((1, "x"), {}),
        ((1,), {"c": (9,)}),
        ((1, "y", (3,)), {"e": (4,)}),
    ]
    for args, kwargs in cases:
        assert _state(Fast(*args, **kwargs)) == _state(Plain(*args, **kwargs))
    # a default factory runs for every object, as the dataclass runs it
    calls: list[int] = []

    def factory() -> tuple[int, ...]:
        calls.append(1)
        return tuple(calls)

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Counted:
        e: tuple[int, ...] = field(default_factory=factory)

    assert Counted().e == (1,) and Counted().e == (1, 1) and Counted((5,)).e == (5,) and len(calls) == 2
    assert str(inspect.signature(Fast.__init__)) == str(inspect.signature(Plain.__init__))


def test_still_frozen_equal_and_hashed() -> None:
    one, two = Fast(1, "b", (3,)), Fast(1, "b", (3,))
    assert one == two and hash(one) == hash(two) and one != Fast(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.a = 5
    with pytest.raises(TypeError):
        Fast()  # a required field stays required
    with pytest.raises(TypeError):
        Fast(1, "b", (3,), (4,))  # and keyword-only stays keyword-only


def test_refuses_what_it_cannot_reproduce() -> None:
    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        scale: InitVar[int] = 1

    for cls in (NoSlots, NotFrozen, PostInit, WithInitVar):
        with pytest.raises(TypeError):
            fast_init(cls)


@pytest.mark.parametrize(
    "cls",
    [
        types.Decision,
        types.CandidateScore,
        types.Rejection,
        types.Observation,
        types.PrefillLeg,
        types.InstanceView,
        types.RequestView,
        estimate.PrefillEstimate,
        estimate.DecodeEstimate,
    ],
)
def test_the_hot_value_objects_use_it(cls: type) -> None:
    # the classes a decision builds by the dozen carry the fast __init__, with the dataclass's signature
    init = cls.__dict__["__init__"]
    assert "_set0" in init.__code__.co_names
    assert init.__qualname__ == f"{cls.__qualname__}.__init__"


def test_a_decision_is_built_as_before() -> None:
    candidate = types.CandidateScore("p0", types.Role.PREFILL, 0.5)
    decision = types.Decision(
        "r1", "kvcache_aware", prefill="p0", decode="d0", predicted_ttft_s=0.5, candidates=(candidate,), unlisted_candidates=2
    )
    assert (decision.prefill, decision.decode, decision.rejection, decision.pull_tokens) == ("p0", "d0", None, 0)
    assert candidate.detail == {} and decision.candidates == (candidate,)
    assert decision == dataclasses.replace(decision)
