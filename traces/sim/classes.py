"""Priority classes and tenants in the simulator (issue 37): what a run is given of them.

A simulation with `SimConfig.classes` treats each trace request as the gateway treats one sent with
`x-priority: <TraceRequest.priority>` by the tenant `TraceRequest.tenant`: before the policy decides,
its `Admission` names its class (and its tenant as the gateway knows it) and admits it into the
gateway's in-flight shares or refuses it (the reason is counted as a rejection); it leaves them when
it ends (its last token, or the policy's 429). Its SLO is its class's (`slos`), the one the policy
judges it by and the results score it by; a ClassAware policy is told `rules` once, before the run,
as the gateway tells it at start-up.

traces may not import the gateway (tests/test_import_rules.py), so the gateway's own code comes in
through the `Admission` protocol and the values here: benchmarks/sim_gateway_classes.py builds them
from a gateway settings dict with conductor/routing/priority.py's Classifier and
conductor/routing/shares.py's Shares over the request path's InflightLimit, on the simulated clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from conductor.core.classes import ClassRules
from conductor.core.types import Slo
from traces.sim.cluster import Job


class Admission(Protocol):
    """The gateway's admission before the policy, for one run."""

    def classify(self, priority: str | None, tenant: str | None) -> tuple[str | None, str | None]:
        """(the request's class, its tenant as the gateway knows it: None for one it has no key of);
        raises as the gateway answers 400 for a class that is not one."""
        ...

    def enter(self, priority: str | None, tenant: str | None) -> str | None:
        """None when admitted into the in-flight limit (then `leave` once), else the refusal's reason."""
        ...

    def leave(self, tenant: str | None) -> None: ...


@dataclass(frozen=True, slots=True)
class SimClasses:
    """The classes and tenants of a simulation (module docstring)."""

    rules: ClassRules  # what a ClassAware policy is told
    slos: Mapping[str, Slo]  # class -> its SLO (the gateway's Router.slo_for without headers)
    # a fresh Admission reading the simulated clock (called once per run; picklable, for worker processes)
    admission: Callable[[Callable[[], float]], Admission]


def admit(gate: Admission, classes: SimClasses, job: Job, default_slo: Slo) -> str | None:
    """Set the job's class, tenant and SLO, and enter it (None: admitted, else the refusal's reason)."""
    job.cls, job.tenant = gate.classify(job.req.priority, job.req.tenant)
    job.slo = classes.slos.get(job.cls, default_slo) if job.cls is not None else default_slo
    return gate.enter(job.cls, job.tenant)
