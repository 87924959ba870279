"""What a policy may offer beside the `Policy` protocol, as protocols the gateway checks with
isinstance instead of probing attributes by name.

Each is optional: a policy without it is served as well, only without that part (no lessons
shared between processes, no prefills on decode instances, no prediction error metrics). They are
`runtime_checkable`, so an isinstance check looks for the members' names only; the types here
are what the gateway relies on once the check passed.

Core imports nothing of the project outside core, so the predictors' own types appear here as the small
protocols the gateway uses of them (`OnlineLearner`, `PredictionError`).
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from typing import Protocol, runtime_checkable

from conductor.core.classes import ClassRules

# one sample a model learned, in the form sibling processes exchange (predictors/lessons.py)
Lesson = tuple[str | int | float, ...]


@runtime_checkable
class OnlineLearner(Protocol):
    """Fitted models that learn online and can share what they learn (predictors.online.Predictors)."""

    def record_lessons(self) -> MutableSequence[Lesson]:
        """From now on keep every sample learned, as lessons for the sibling processes, in the
        sequence returned (the caller empties it as it publishes them)."""
        ...

    def learn(self, raw: object) -> None:
        """Learn a sibling's lesson as if this process had made the observation."""
        ...


@runtime_checkable
class LearnsOnline(Protocol):
    """A policy whose predictors refit online (kvcache_aware): under `conductor serve --workers N`
    what they learn is shared with the sibling processes."""

    @property
    def predictors(self) -> object:
        """Its fitted models: an `OnlineLearner` when they learn online (checked by the gateway)."""
        ...


@runtime_checkable
class LocalPrefiller(Protocol):
    """A policy that may place a prefill on a decode instance (policies/local_prefill.py): `local`
    is its planner, None when the option is off. Such a decision needs decodes that compute a
    request without a KV transfer."""

    @property
    def local(self) -> object | None: ...


@runtime_checkable
class PredictionError(Protocol):
    """One component's prediction error on one instance (predictors.errors.ErrorStats)."""

    @property
    def component(self) -> str: ...

    @property
    def instance(self) -> str: ...

    @property
    def samples(self) -> int: ...

    @property
    def mape(self) -> float: ...

    @property
    def p90_coverage(self) -> float: ...


@runtime_checkable
class ReportsPredictionErrors(Protocol):
    """A policy with fitted predictors that tracks how wrong they are (exported on /metrics)."""

    def error_stats(self) -> Sequence[PredictionError]: ...


def local_prefill_enabled(policy: object) -> bool:
    """Whether `policy` may prefill on decode instances (a LocalPrefiller with its planner on)."""
    return isinstance(policy, LocalPrefiller) and policy.local is not None


def online_learner(policy: object) -> OnlineLearner | None:
    """The predictors of a policy that learns online, None for any other policy."""
    if not isinstance(policy, LearnsOnline):
        return None
    learner = policy.predictors
    return learner if isinstance(learner, OnlineLearner) else None


@runtime_checkable
class ClassAware(Protocol):
    """A policy whose admission knows the gateway's priority classes and tenants (kvcache_aware),
    told them once at start-up (conductor/routing/router.py)."""

    def configure_classes(self, rules: ClassRules) -> None: ...
