"""Options the simulator sets for speed must not change what a simulation decides or reports."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import pytest

from policies.kvcache_aware import KvCacheAwarePolicy
from traces.formats import load_trace, resolve_trace
from traces.sim.engine import simulate
from traces.sim.options import add_cluster_args, config_from_args
from traces.sim.runner import FittedAdmission, PolicySpec, build_policy

HEAD = "conversation-head400"


def _config(*argv: str, pd: tuple[int, int] = (2, 2)):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return config_from_args(parser.parse_args(["--paper", *argv]), *pd)


def _fields(result: object) -> dict[str, object]:
    out = asdict(result)  # type: ignore[call-overload]
    out.pop("wall_s")
    return out


def test_error_tracking_off_changes_no_result_and_keeps_no_errors() -> None:
    # overloaded (3x, 6 s TTFT SLO): admission rejects, the predictors refit, the bounds move
    config = _config("--speedup", "3", "--slo-ttft", "6")
    reqs = load_trace(resolve_trace(HEAD)).requests
    tracked = KvCacheAwarePolicy(listed_candidates=1, refit_every=8)
    untracked = KvCacheAwarePolicy(listed_candidates=1, refit_every=8, track_errors=False)
    a, b = simulate(tracked, reqs, config), simulate(untracked, reqs, config)
    assert a.rejected > 0 and tracked.predictors.refits > 10
    assert _fields(a) == _fields(b)
    assert tracked.predictors.refits == untracked.predictors.refits
    assert tracked.predictors.params == untracked.predictors.params  # the same fits, bit for bit
    assert tracked.error_stats() and not untracked.error_stats()


def test_the_runner_turns_error_tracking_off() -> None:
    config = _config()
    policy = build_policy(PolicySpec("kvcache_aware"), config)
    assert isinstance(policy, KvCacheAwarePolicy) and not policy.predictors.tracks_errors
    fitted = build_policy(PolicySpec.parse("round_robin:fit_predictors=true"), config)
    assert isinstance(fitted, FittedAdmission) and not fitted.judge.predictors.tracks_errors
    assert fitted.judge.listed_candidates == 1
    kept = build_policy(PolicySpec.parse("kvcache_aware:track_errors=true"), config)
    assert isinstance(kept, KvCacheAwarePolicy) and kept.predictors.tracks_errors


def test_a_run_leaves_the_collector_as_it_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from traces.sim import engine

    config = _config()
    reqs = load_trace(resolve_trace(HEAD)).requests[:50]
    # an earlier test in this process (under xdist, any file's: the gateway's GcFreezer) may have
    # frozen objects; unfrozen, they are only scanned again, and this test starts from none
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    first = simulate(KvCacheAwarePolicy(listed_candidates=1), reqs, config)
    assert gc.get_freeze_count() == 0 and gc.isenabled()  # frozen for the run only
    # someone else's frozen objects: the run neither adds to them nor undoes them. Its own calls
    # are counted, not the collector's figure, which a gateway an earlier test left in this
    # process may move meanwhile (its GcFreezer's round)
    calls: list[str] = []

    class _CountingGc:
        isenabled = staticmethod(gc.isenabled)

        @staticmethod
        def get_freeze_count() -> int:
            return 1  # objects frozen by someone else

        @staticmethod
        def freeze() -> None:
            calls.append("freeze")

        @staticmethod
        def unfreeze() -> None:
            calls.append("unfreeze")

    monkeypatch.setattr(engine, "gc", _CountingGc)
    again = simulate(KvCacheAwarePolicy(listed_candidates=1), reqs, config)
    assert calls == []
    assert _fields(first) == _fields(again)
