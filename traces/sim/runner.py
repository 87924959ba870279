"""Running simulations by policy name, several at once on all cores.

A policy spec is a registered name with optional options: ``name`` or
``name:key=value:key2=value2`` (values parsed as YAML, so numbers and booleans work). Each run
builds a fresh policy through `policies.registry.load_policy`, exactly as the gateway does, so
plugins work and no fitted state leaks between runs.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from policies.registry import load_policy
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


def run_job(job: SimJob, requests: Sequence[TraceRequest] | None = None) -> RunResult:
    """Run one simulation; loads the trace unless `requests` is given."""
    reqs = requests if requests is not None else load_requests(job.trace, job.limit)
    policy = load_policy(job.spec.name, job.spec.options)
    result = simulate(policy, reqs, job.config)
    return replace(result, policy=job.spec.label or job.spec.name)


def _worker(job: SimJob) -> RunResult:
    return run_job(job)


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
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context(method)) as pool:
        return list(pool.map(_worker, jobs))


def config_for(base: SimConfig, **changes: Any) -> SimConfig:
    """A copy of `base` with some fields changed (sweeps vary n_prefill/n_decode)."""
    return replace(base, **changes)
