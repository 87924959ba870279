"""The policy's KV index in the simulator (SimConfig.index_delay_s): exact by default, a finished prefill's
blocks learned `index_delay_s` late (a live index's KV events), or no KV awareness at all (no block keys,
no cached prefix); the instances reuse what they hold whichever the policy sees."""

from __future__ import annotations

import argparse

import pytest

from tests.traces.test_sim_engine import Scripted, cfg, req, to
from traces.sim.engine import simulate
from traces.sim.options import add_cluster_args, config_from_args

# a 3-block prompt, then the same prefix extended at t=5 s and t=30 s (its prefill is done well before 5 s)
TRACE = [req(0.0, 1536, 2, (1, 2, 3)), req(5.0, 2048, 2, (1, 2, 3, 4), line=2), req(30.0, 2048, 2, (1, 2, 3, 5), line=3)]


def _seen(delay: float | None) -> tuple[Scripted, list[int]]:
    """The policy after the run, and what its index reported on prefill-0 for each request."""
    policy = Scripted(to(0))
    simulate(policy, TRACE, cfg(index_delay_s=delay))
    cached = [view.cached.get("prefill-0") for view, _ in policy.seen]
    return policy, [0 if c is None else c.tokens for c in cached]


def test_an_exact_index_reports_a_prefix_once_its_prefill_is_done() -> None:
    policy, cached = _seen(0.0)
    assert cached == [0, 1536, 1536]
    assert [len(view.block_keys) for view, _ in policy.seen] == [3, 4, 4]


def test_a_late_index_reports_it_only_after_the_delay_while_the_instance_reuses_it_at_once() -> None:
    policy, cached = _seen(10.0)
    assert cached == [0, 0, 1536]  # at 5 s the index has not heard of the first prefill; by 30 s it has
    reused = sorted((o.request_id, o.cached_tokens) for o in policy.observed)
    assert reused == [("r0", 0), ("r1", 1536), ("r2", 1536)]  # the worker's own cache is exact either way


def test_no_kv_awareness_shows_no_block_keys_and_no_prefix() -> None:
    policy, cached = _seen(None)
    assert cached == [0, 0, 0] and [view.block_keys for view, _ in policy.seen] == [(), (), ()]
    assert sorted(o.cached_tokens or 0 for o in policy.observed) == [0, 1536, 1536]


def test_the_options_and_their_check() -> None:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    assert config_from_args(parser.parse_args([]), 1, 1).index_delay_s == 0.0
    assert config_from_args(parser.parse_args(["--index-delay", "4"]), 1, 1).index_delay_s == 4.0
    assert config_from_args(parser.parse_args(["--no-index"]), 1, 1).index_delay_s is None
    with pytest.raises(ValueError, match="index_delay_s"):
        cfg(index_delay_s=-1.0)
