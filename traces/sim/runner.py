"""Running simulations by policy name, several at once on all cores.

A policy spec is a registered name with optional options: ``name`` or
``name:key=value:key2=value2`` (values parsed as YAML, so numbers and booleans work). Each run
builds a fresh policy through `policies.registry.load_policy`, exactly as the gateway does, so
plugins work and no fitted state leaks between runs.

Two options are the simulator's, not the policy's:

* ``allow_pull`` is filled in from `SimConfig.pull` for policies that take it (kvcache_aware) and
  whose spec does not set it, so they plan only pulls the simulated cluster can do.
* ``fit_predictors=true`` on any policy without its own predictors (the baselines): its placement
  is judged by a KvCacheAwarePolicy (`JudgedPolicy`, policies/judged.py: the gateway's `judged`
  policy, here named `FittedAdmission`) with the same online-fitted predictors, calibrated bounds
  and admission mode (the spec's ``admission``, default ``predicted``) as kvcache_aware, learning
  from the baseline's own outcomes; the baseline itself then runs without admission. Without it, a
  baseline's ``admission`` uses fixed (never refitted) predictors. ``judged:place=round_robin``
  builds the same as the gateway configures it (its judge with kvcache_aware's defaults).

And one is set for speed: ``listed_candidates`` is 1 for policies that take it and whose spec does
not set it (kvcache_aware, dynamo_kv, llmd, least_loaded, sglang_cache_aware). A decision still
weighs every instance (the differential test holds a listed decision to the list-everything one,
tests/policies/test_baseline_policies.py the baselines'); it only builds the chosen instances'
scores into `Decision.candidates`, the part a gateway logs. Nothing in a simulation logs them, and
building eight of each per decision was a sixth of kvcache_aware's simulation time. For the same
reason ``track_errors`` is false for policies that take it (kvcache_aware): the per-instance error
windows a gateway exports feed no decision and nothing in a simulation reads them (RunResult's
prediction errors are the engine's own). A `FittedAdmission` judge gets both, and so does a
``judged`` spec's (its signature takes both, and not ``allow_pull``: a judged placement pulls nothing).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from conductor.core.types import Policy
from policies.judged import JudgedPolicy
from policies.kvcache_aware import KvCacheAwarePolicy
from policies.registry import available_policies, load_policy
from traces.formats import TraceRequest, load_trace, resolve_trace
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.results import RunResult


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy to load by name, with its options and the label results carry."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""  # defaults to the spec text

    @staticmethod
    def parse(text: str) -> PolicySpec:
        name, *opts = text.strip().split(":")
        if not name:
            raise ValueError(f"empty policy name in {text!r}")
        options: dict[str, Any] = {}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep or not key:
                raise ValueError(f"policy option {opt!r} in {text!r} is not key=value")
            options[key.strip()] = yaml.safe_load(value)
        return PolicySpec(name, options, text.strip())


@dataclass(frozen=True, slots=True)
class SimJob:
    """One simulation to run: which policy on which cluster over which trace slice."""

    spec: PolicySpec
    config: SimConfig
    trace: str  # path or bundled name; each worker process loads it itself
    limit: int | None = None


def parse_specs(text: str) -> list[PolicySpec]:
    """Comma-separated policy specs, as `--compare` takes them."""
    return [PolicySpec.parse(part) for part in text.split(",") if part.strip()]


def load_requests(trace: str | Path, limit: int | None = None) -> tuple[TraceRequest, ...]:
    result = load_trace(resolve_trace(trace), limit=limit)
    if not result.requests:
        detail = f"; first error: {result.errors[0]}" if result.errors else ""
        raise ValueError(f"trace {trace} has no usable requests{detail}")
    return result.requests


# the simulator's name for it, kept for its callers (tests, benchmarks, docs/simulator.md)
FittedAdmission = JudgedPolicy


def _factory(name: str) -> object:
    ep = available_policies().get(name)
    try:
        return ep.load() if ep is not None else None
    except Exception:  # noqa: BLE001 - load_policy reports a broken plugin properly; here it gets no options
        return None


def _accepts(factory: object, option: str) -> bool:
    """Whether a policy factory takes `option` (False when its signature cannot be read)."""
    try:
        params = inspect.signature(factory).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return option in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


SIM_LISTED_CANDIDATES = 1  # see the module docstring


def build_policy(spec: PolicySpec, config: SimConfig) -> Policy:
    """The policy a spec names, with the simulator's options applied (see the module docstring)."""
    options = dict(spec.options)
    fit = bool(options.pop("fit_predictors", False))
    factory = _factory(spec.name)
    if "allow_pull" not in options and _accepts(factory, "allow_pull"):
        options["allow_pull"] = config.pull_links
    if "listed_candidates" not in options and _accepts(factory, "listed_candidates"):
        options["listed_candidates"] = SIM_LISTED_CANDIDATES
    if "track_errors" not in options and _accepts(factory, "track_errors"):
        options["track_errors"] = False
    if not fit or (isinstance(factory, type) and issubclass(factory, KvCacheAwarePolicy)):
        return load_policy(spec.name, options)  # kvcache_aware fits its own predictors anyway
    admission = str(options.pop("admission", "predicted"))
    judge = KvCacheAwarePolicy(admission=admission, allow_pull=False, listed_candidates=SIM_LISTED_CANDIDATES, track_errors=False)
    return JudgedPolicy(load_policy(spec.name, options), judge)


def run_job(job: SimJob, requests: Sequence[TraceRequest] | None = None) -> RunResult:
    """Run one simulation; loads the trace unless `requests` is given."""
    reqs = requests if requests is not None else load_requests(job.trace, job.limit)
    policy = build_policy(job.spec, job.config)
    result = simulate(policy, reqs, job.config)
    return replace(result, policy=job.spec.label or job.spec.name)


# traces loaded by the parent before it forks its workers, which inherit them instead of each
# parsing the same file again (about half a second for the conversation trace)
_PRELOADED: dict[tuple[str, int | None], tuple[TraceRequest, ...]] = {}


def _worker(job: SimJob) -> RunResult:
    return run_job(job, _PRELOADED.get((job.trace, job.limit)))


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def run_jobs(jobs: Sequence[SimJob], *, workers: int | None = None) -> list[RunResult]:
    """Run simulations in parallel processes (one per core by default); results in job order."""
    n = min(len(jobs), workers or default_workers())
    if n <= 1:
        cache: dict[tuple[str, int | None], tuple[TraceRequest, ...]] = {}
        out = []
        for job in jobs:
            key = (job.trace, job.limit)
            if key not in cache:
                cache[key] = load_requests(job.trace, job.limit)
            out.append(run_job(job, cache[key]))
        return out
    # fork where the platform has it: workers start in milliseconds and inherit imports
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "fork":
        for job in jobs:
            key = (job.trace, job.limit)
            if key not in _PRELOADED:
                _PRELOADED[key] = load_requests(job.trace, job.limit)
    try:
        with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context(method)) as pool:
            return list(pool.map(_worker, jobs))
    finally:
        _PRELOADED.clear()


def config_for(base: SimConfig, **changes: Any) -> SimConfig:
    """A copy of `base` with some fields changed (sweeps vary n_prefill/n_decode)."""
    return replace(base, **changes)
