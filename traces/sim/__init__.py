"""Discrete-event simulation of a P/D-disaggregated cluster that runs the real policy objects.

    from policies.registry import load_policy
    from traces.formats import bundled_trace, load_trace
    from traces.sim import SimConfig, fit_truth, simulate

    trace = load_trace(bundled_trace("conversation")).requests
    config = SimConfig(n_prefill=8, n_decode=8, truth=fit_truth(prefill_scale=7.0))
    result = simulate(load_policy("kvcache_aware"), trace, config)   # a RunResult
    print(result.ttft.mean, result.goodput_rps)

Modules: `truth` (ground-truth timing fitted from a profile), `cluster` (instance state), `engine`
(the event loop), `results` (RunResult, table, JSON), `runner` (by policy name, in parallel),
`options` (CLI flags shared by `conductor replay` and `conductor tune-pd`).
"""

from traces.sim.config import SimConfig
from traces.sim.engine import Simulator, simulate
from traces.sim.results import Dist, PredictionError, RunResult, format_table
from traces.sim.truth import DecodeTruth, TruthModel, fit_truth

__all__ = [
    "DecodeTruth",
    "Dist",
    "PredictionError",
    "RunResult",
    "SimConfig",
    "Simulator",
    "TruthModel",
    "fit_truth",
    "format_table",
    "simulate",
]
