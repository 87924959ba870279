"""A cheaper `__init__` for the frozen, slotted dataclasses built on every decision.

A frozen dataclass's generated `__init__` stores each field through `object.__setattr__(self,
"name", value)`: a global lookup, an attribute lookup and a call that looks the slot up by name,
per field. A decision builds a dozen such objects (the Decision, its CandidateScores, the
policy's estimates), the gateway for every request and the simulator for every one of a trace's
thousands. `fast_init` replaces the generated `__init__` with one of the same signature that
stores each field through its slot's own descriptor (`member_descriptor.__set__`), about 0.65x
the time for an eleven-field Decision. The objects are the same: frozen (assignment still
raises FrozenInstanceError), equal and hashed as before, defaults and default factories applied
as the dataclass applies them (tests/conductor/core/test_fast_init.py).

Only for what it can reproduce exactly: a frozen dataclass with slots, no `__post_init__`,
and the same parameters as the generated `__init__` (no InitVar); anything else fails at import,
where the decorator is applied.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def fast_init(cls: T) -> T:
    """Give a `@dataclass(frozen=True, slots=True)` class an `__init__` that stores its slots
    directly; apply it above (after) the dataclass decorator."""
    params = getattr(cls, "__dataclass_params__", None)
    if not is_dataclass(cls) or params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init needs a frozen dataclass with slots, not {cls!r}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"fast_init cannot reproduce {cls.__name__}'s __post_init__")
    generated = inspect.signature(cls.__init__).parameters
    namespace: dict[str, Any] = {}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for number, f in enumerate(fields(cls)):
        descriptor = _slot_descriptor(cls, f.name)
        namespace[f"_set{number}"] = descriptor.__set__
        if not f.init:  # a field the caller cannot pass: its default, as the dataclass sets it
            if f.default_factory is not MISSING:
                namespace[f"_factory{number}"] = f.default_factory
                body.append(f"_set{number}(self, _factory{number}())")
            elif f.default is not MISSING:
                namespace[f"_default{number}"] = f.default
                body.append(f"_set{number}(self, _default{number})")
            continue
        if f.default is not MISSING:
            namespace[f"_default{number}"] = f.default
            param = f"{f.name}=_default{number}"
        elif f.default_factory is not MISSING:
            # the generated __init__'s own marker for "not passed", so the signatures are equal
            namespace[f"_factory{number}"] = f.default_factory
            namespace[f"_unset{number}"] = generated[f.name].default
            param = f"{f.name}=_unset{number}"
            body.append(f"if {f.name} is _unset{number}: {f.name} = _factory{number}()")
        else:
            param = f.name
        (keyword if f.kw_only else positional).append(param)
        body.append(f"_set{number}(self, {f.name})")
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({signature}):\n    " + "\n    ".join(body or ["pass"])
    exec(source, namespace)  # built from the class's own field names, as dataclasses builds its own
    init = namespace["__init__"]
    # the same parameters, in the same order, kinds and defaults (an InitVar, which fields() leaves
    # out, would show here as a parameter the generated __init__ has and this one lacks)
    if _parameters(init) != _parameters(cls.__init__):
        raise TypeError(f"fast_init cannot reproduce {cls.__name__}.__init__{inspect.signature(cls.__init__)}")
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def _parameters(function: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _slot_descriptor(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        descriptor = klass.__dict__.get(name)
        if descriptor is not None and hasattr(descriptor, "__set__"):
            return descriptor
    raise TypeError(f"{cls.__name__}.{name} has no slot")
