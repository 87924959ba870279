"""The staging answer -> pull params rule and the peer source list (conductor/routing/peer_pull.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from conductor.core.types import CachedPrefix, Role, Tier
from conductor.kv.analysis import PromptAnalysis
from conductor.routing.peer_pull import peer_sources, pull_params

# a vLLM 0.32 NIXL producer's answer to a 289-token staging request (block size 32: 10 blocks,
# the last one partial), as pull_scheduler.request_finished writes it
ANSWER: dict[str, Any] = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16]],
        "remote_engine_id": "e-1",
        "remote_request_id": "cmpl-x-stage-0-abc",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 289,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 288,
    }
}


def test_the_pull_names_the_prefix_blocks_only() -> None:
    assert pull_params(ANSWER, 288, 32) == {
        "remote_block_ids": [[7, 8, 9, 10, 11, 12, 13, 14, 15]],
        "remote_engine_id": "e-1",
        "remote_request_id": "cmpl-x-stage-0-abc",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
        "remote_num_tokens": 288,
    }


@pytest.mark.parametrize(
    "change",
    [
        {"remote_block_ids": [[1, 2]]},  # fewer blocks than the prefix
        {"remote_block_ids": [[1] * 10, [2] * 10]},  # two KV cache groups
        {"remote_block_ids": [1, 2, 3]},  # not one list per group
        {"remote_block_ids": [[-1] * 10]},
        {"remote_port": 0},
        {"remote_port": "x"},
        {"remote_host": None},
        {"remote_engine_id": 3},
        {"dcp_size": 2},
        {"pp_size": 2},
    ],
)
def test_unusable_answers_give_no_pull(change: dict[str, Any]) -> None:
    assert pull_params({"kv_transfer_params": {**ANSWER["kv_transfer_params"], **change}}, 288, 32) is None


def test_no_params_no_pull() -> None:
    assert pull_params({"kv_transfer_params": None}, 288, 32) is None
    assert pull_params("x", 288, 32) is None
    assert pull_params(ANSWER, 0, 32) is None


def test_sources_are_healthy_prefills_holding_enough_whole_blocks() -> None:
    def state(role: Role, healthy: bool = True) -> SimpleNamespace:
        return SimpleNamespace(spec=SimpleNamespace(role=role), healthy=healthy)

    holders = {
        "p0": state(Role.PREFILL),
        "p1": state(Role.PREFILL, healthy=False),
        "p2": state(Role.PREFILL),
        "p3": state(Role.PREFILL),
        "d0": state(Role.DECODE),
        "p4": state(Role.PREFILL),
    }
    analysis = PromptAnalysis(
        prompt_tokens=300,
        exact=True,
        cached={
            "p0": CachedPrefix(320),
            "p1": CachedPrefix(288),
            "p2": CachedPrefix(32),
            "p3": CachedPrefix(288, Tier.STORE),
            "d0": CachedPrefix(288),
            "p4": CachedPrefix(128),
            "gone": CachedPrefix(288),
        },
    )
    # p0's prefix is cut to the prompt's last whole block before its last token; p1 unhealthy; p2
    # under the minimum; p3 only in the store; d0 no prefill; p4 excluded by the caller
    assert peer_sources(analysis, holders, lambda iid: iid != "p4", 16, 64) == {"p0": 288}
