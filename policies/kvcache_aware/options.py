"""kvcache_aware's options: the flat `policy_options` keys users write, typed and checked.

Users give them flat, as before: `policy_options:` in the YAML, `kvcache_aware:key=value` on the
command line, keywords to `KvCacheAwarePolicy(...)`. `KvCacheAwareOptions.from_mapping` files each
key under its group; every group checks its fields when it is built, so a mistake stops start-up
with a ConfigError naming the key and what it allows, instead of a TypeError in the first decision
or a misplaced request much later. Each field carries its flat key and its check (`_option`): the
one table both directions are read from. What each group does, its defaults and the evidence
behind them: docs/kvcache_aware.md.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

from conductor.core.errors import ConfigError
from policies.admission import AdmissionMode
from predictors.params import INSTANCE_LINK, STORE_LINK

POLICY = "kvcache_aware"


def _refused(key: str, allowed: str, value: object) -> ConfigError:
    return ConfigError(f"{POLICY} option {key!r} must be {allowed}, not {value!r}", param=key)


@dataclass(frozen=True, slots=True)
class Flag:
    """true or false (YAML reads yes/no as those too); a number or a string here is a mistake."""

    allowed: str = "true or false"

    def __call__(self, key: str, value: object) -> bool:
        if isinstance(value, bool):
            return value
        raise _refused(key, self.allowed, value)


@dataclass(frozen=True, slots=True)
class Whole:
    """A whole number of at least `minimum`, kept as an int (100.0 is 100: the counts took it);
    with `null`, None too (what None means)."""

    minimum: int
    null: str | None = None

    @property
    def allowed(self) -> str:
        text = f"a whole number >= {self.minimum}"
        return text if self.null is None else f"{text}, or null ({self.null})"

    def __call__(self, key: str, value: object) -> int | None:
        if value is None and self.null is not None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= self.minimum:
            return value
        raise _refused(key, self.allowed, value)


@dataclass(frozen=True, slots=True)
class Real:
    """A finite number in `low`..`high` (each end open or closed), kept as a float; with `null`,
    None too. Whole numbers are numbers: `ttft_slack: 1` is 1.0, as it always was."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    null: str | None = None

    @property
    def allowed(self) -> str:
        if self.high == math.inf:
            text = f"a number {'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return text if self.null is None else f"{text}, or null ({self.null})"

    def __call__(self, key: str, value: object) -> float | None:
        if value is None and self.null is not None:
            return None
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            number = float(value)
            above = number > self.low if self.low_open else number >= self.low
            below = number < self.high if self.high_open else number <= self.high
            if above and below:
                return number
        raise _refused(key, self.allowed, value)


ADMISSION_MODES = tuple(m.value for m in AdmissionMode)


@dataclass(frozen=True, slots=True)
class Mode:
    """An admission mode by name (policies.admission.AdmissionMode)."""

    allowed: str = "one of " + ", ".join(ADMISSION_MODES)

    def __call__(self, key: str, value: object) -> AdmissionMode:
        if isinstance(value, str) and value in ADMISSION_MODES:
            return AdmissionMode(value)
        raise _refused(key, self.allowed, value)


PULL_LINKS: Mapping[str, tuple[str, ...]] = {
    "both": (INSTANCE_LINK, STORE_LINK),
    "peer": (INSTANCE_LINK,),
    "store": (STORE_LINK,),
    "none": (),
}


@dataclass(frozen=True, slots=True)
class Links:
    """true (both links), false (none), or a link class by name; kept as given."""

    allowed: str = "true, false, " + ", ".join(PULL_LINKS)

    def __call__(self, key: str, value: object) -> bool | str:
        if isinstance(value, bool) or (isinstance(value, str) and value in PULL_LINKS):
            return value
        raise _refused(key, self.allowed, value)


@dataclass(frozen=True, slots=True)
class FilePath:
    """A file's path (a string or a path object, kept as a string), or null."""

    allowed: str = "a file path, or null (the bundled profile)"

    def __call__(self, key: str, value: object) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return str(os.fspath(value))
        raise _refused(key, self.allowed, value)


def pull_links(allow_pull: bool | str) -> frozenset[str]:
    """Link classes a policy may pull prefixes over: True/"both", "peer", "store", False/"none"."""
    links = ("both" if allow_pull else "none") if isinstance(allow_pull, bool) else allow_pull
    if links not in PULL_LINKS:
        raise _refused("allow_pull", Links().allowed, allow_pull)
    return frozenset(PULL_LINKS[links])


def _option(key: str, check: Any) -> dict[str, Any]:
    """A group's field's metadata: its flat key (what users write) and the check its value must pass."""
    return {"key": key, "check": check}


# the checks several options share
QUANTILE = Real(0.0, 1.0, null="the point prediction")  # a calibrated bound's quantile
SLACK = Real(0.0, 1.0, low_open=True, null="the lowest TTFT")  # a share of the TTFT SLO


class _Checked:
    """Checks every field of a group when it is built, against the check its `_option` names."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            checked = f.metadata["check"](f.metadata["key"], getattr(self, f.name))
            object.__setattr__(self, f.name, checked)  # frozen: the one write, while being built


@dataclass(frozen=True, slots=True)
class PrefixOptions(_Checked):
    """Where a request's prefix may come from besides its instance's own cache."""

    allow_pull: bool | str = field(default=True, metadata=_option("allow_pull", Links()))
    inflight: bool = field(default=True, metadata=_option("inflight_prefixes", Flag()))
    max_inflight_keys: int = field(default=200_000, metadata=_option("max_inflight_keys", Whole(1)))


@dataclass(frozen=True, slots=True)
class PlacementOptions(_Checked):
    """Which prefill instance wins, and how many a decision lists."""

    ttft_slack: float | None = field(default=1.0, metadata=_option("ttft_slack", SLACK))
    listed_candidates: int | None = field(default=8, metadata=_option("listed_candidates", Whole(1, null="list every instance")))


@dataclass(frozen=True, slots=True)
class AdmissionOptions(_Checked):
    """When a request is turned away before anything is forwarded, and on what bounds."""

    mode: AdmissionMode = field(default=AdmissionMode.PREDICTED, metadata=_option("admission", Mode()))
    ttft_quantile: float | None = field(default=0.95, metadata=_option("ttft_quantile", QUANTILE))
    tbt_quantile: float | None = field(default=0.9, metadata=_option("tbt_quantile", QUANTILE))
    ttft_bound_shift_s: float = field(default=0.0, metadata=_option("ttft_bound_shift_s", Real(0.0)))
    probe_after: int | None = field(default=100, metadata=_option("probe_after", Whole(0, null="never probe")))
    forecast_joins: bool = field(default=False, metadata=_option("forecast_joins", Flag()))


@dataclass(frozen=True, slots=True)
class MixedOptions(_Checked):
    """Placement and admission on mixed workers (prefill and decode on one engine)."""

    tbt_quantile: float | None = field(default=0.5, metadata=_option("mixed_tbt_quantile", QUANTILE))
    ttft_slack: float | None = field(default=0.8, metadata=_option("mixed_ttft_slack", SLACK))
    protect_streams: bool = field(default=True, metadata=_option("mixed_protect_streams", Flag()))
    pace_floor: bool = field(default=False, metadata=_option("mixed_pace_floor", Flag()))


@dataclass(frozen=True, slots=True)
class LocalPrefillOptions(_Checked):
    """Prefills on a decode instance itself (policies/local_prefill.py); 0 tokens: off."""

    tokens: int = field(default=0, metadata=_option("local_prefill_tokens", Whole(0)))
    duty: float = field(default=0.15, metadata=_option("local_prefill_duty", Real(0.0, 1.0, low_open=True, high_open=True)))
    gain: float = field(default=0.8, metadata=_option("local_prefill_gain", Real(0.0, 1.0, low_open=True)))


@dataclass(frozen=True, slots=True)
class LearningOptions(_Checked):
    """The predictors: where they start, and how they learn online (predictors.online)."""

    predictor_params: str | None = field(default=None, metadata=_option("predictor_params", FilePath()))
    online: bool = field(default=True, metadata=_option("online", Flag()))
    window: int = field(default=512, metadata=_option("window", Whole(1)))
    refit_every: int = field(default=32, metadata=_option("refit_every", Whole(1)))
    mixed_refit_every: int = field(default=8, metadata=_option("mixed_refit_every", Whole(1)))
    mixed_recent: int = field(default=8, metadata=_option("mixed_recent", Whole(0)))
    refit_queue_fraction: float = field(default=0.2, metadata=_option("refit_queue_fraction", Real(0.0)))
    max_pending: int = field(default=65536, metadata=_option("max_pending", Whole(1)))
    track_errors: bool = field(default=True, metadata=_option("track_errors", Flag()))


@dataclass(frozen=True, slots=True)
class SessionOptions(_Checked):
    """Where the KV index is blind, a session's prefix assumed on the instance that served it (sessions.py)."""

    affinity: bool = field(default=True, metadata=_option("session_affinity", Flag()))
    # the session's decode, where a readback of the last turn is offered from it, may have this share
    # more TBT now than the least loaded one (the prefill has no slack: the session's prefix is a hint
    # the cost model weighs, sessions.py)
    decode_slack: float = field(default=0.1, metadata=_option("session_decode_slack", Real(0.0)))
    max_sessions: int = field(default=65536, metadata=_option("max_sessions", Whole(1)))


@dataclass(frozen=True, slots=True)
class KvCacheAwareOptions:
    """Every option of the policy, by group; `from_mapping` reads the flat keys, `flat` writes them."""

    prefixes: PrefixOptions = field(default_factory=PrefixOptions)
    placement: PlacementOptions = field(default_factory=PlacementOptions)
    admission: AdmissionOptions = field(default_factory=AdmissionOptions)
    mixed: MixedOptions = field(default_factory=MixedOptions)
    local: LocalPrefillOptions = field(default_factory=LocalPrefillOptions)
    learning: LearningOptions = field(default_factory=LearningOptions)
    sessions: SessionOptions = field(default_factory=SessionOptions)

    GROUPS: ClassVar[Mapping[str, type[_Checked]]] = {
        "prefixes": PrefixOptions,
        "placement": PlacementOptions,
        "admission": AdmissionOptions,
        "mixed": MixedOptions,
        "local": LocalPrefillOptions,
        "learning": LearningOptions,
        "sessions": SessionOptions,
    }

    @classmethod
    def from_mapping(cls, options: Mapping[str, object]) -> KvCacheAwareOptions:
        """The options a flat mapping gives (unnamed ones at their defaults); ConfigError naming
        the key for a key the policy does not have or a value its check refuses."""
        by_group: dict[str, dict[str, object]] = {}
        for key, value in options.items():
            where = OPTION_KEYS.get(key) if isinstance(key, str) else None
            if where is None:
                raise _unknown(key)
            group, name = where
            by_group.setdefault(group, {})[name] = value
        return cls(**{group: cls.GROUPS[group](**values) for group, values in by_group.items()})  # type: ignore[arg-type]

    def flat(self) -> dict[str, object]:
        """The flat mapping `from_mapping` reads, every key with its value here."""
        out: dict[str, object] = {}
        for group in self.GROUPS:
            values = getattr(self, group)
            for f in fields(values):
                value = getattr(values, f.name)
                out[f.metadata["key"]] = value.value if isinstance(value, Enum) else value  # as a user writes it
        return out


def _keys() -> dict[str, tuple[str, str]]:
    """flat key -> (group, field), from the groups' own fields."""
    return {
        f.metadata["key"]: (group, f.name)
        for group, kind in KvCacheAwareOptions.GROUPS.items()
        for f in fields(kind)  # type: ignore[arg-type]
    }


OPTION_KEYS: Mapping[str, tuple[str, str]] = _keys()


def _unknown(key: object) -> ConfigError:
    near = difflib.get_close_matches(str(key), OPTION_KEYS, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    known = ", ".join(sorted(OPTION_KEYS))
    return ConfigError(f"{POLICY} has no option {key!r}{hint}; its options: {known}", param=str(key))
