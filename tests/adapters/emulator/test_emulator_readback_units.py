"""Bidirectional NIXL's pure parts: options, the prefill's handle parsing, content ids of held KV."""

from __future__ import annotations

from typing import Any

import pytest

from adapters.emulator.cli import build_parser, config_from_args
from adapters.emulator.kv_content import (
    RemoteKv,
    Taint,
    content_block_ids,
    content_seed,
    first_mismatch,
    held_block_ids,
    received_taint,
)
from adapters.emulator.protocols import PdProtocol, Role, plan_leg

HANDLE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_block_ids": [[7, 8, 9]],
    "remote_engine_id": "dec",
    "remote_request_id": "cmpl-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 96,
}


def test_options_default_off_and_parse() -> None:
    off = config_from_args(build_parser().parse_args([]))
    assert (off.bidirectional_kv_xfer, off.kv_recompute_threshold, off.decoder_kv_blocks_ttl) == (False, 64, 480.0)
    assert not off.serves_readback and not off.pulls_readback
    on = config_from_args(
        build_parser().parse_args(
            ["--role", "decode", "--bidirectional-kv-xfer", "--kv-recompute-threshold", "128", "--decoder-kv-blocks-ttl", "30"]
        )
    )
    assert (on.bidirectional_kv_xfer, on.kv_recompute_threshold, on.decoder_kv_blocks_ttl) == (True, 128, 30.0)
    assert on.serves_readback and not on.pulls_readback


def test_prefill_reads_the_handle_only_when_complete() -> None:
    plan = plan_leg(Role.PREFILL, PdProtocol.NIXL, {"kv_transfer_params": HANDLE})
    assert plan.nixl_prefill and plan.readback is not None
    assert (plan.readback.request_id, plan.readback.engine_id, plan.readback.num_blocks, plan.readback.num_tokens) == (
        "cmpl-1",
        "dec",
        3,
        96,
    )
    assert plan.readback.url == "http://10.0.0.2:5601/emulator/kv/cmpl-1/read"
    for missing in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids"):
        params = {k: v for k, v in HANDLE.items() if k != missing}
        plan = plan_leg(Role.PREFILL, PdProtocol.NIXL, {"kv_transfer_params": params})
        assert plan.nixl_prefill and plan.readback is None, missing
    # a plain first-turn prefill request carries no handle
    assert plan_leg(Role.PREFILL, PdProtocol.NIXL, {"kv_transfer_params": {"do_remote_decode": True}}).readback is None


def test_held_ids_follow_the_kv_not_the_tokens() -> None:
    tokens = list(range(100))
    clean = content_block_ids(tokens, 16)
    assert held_block_ids(tokens, 16, None) == clean and clean[-1] == content_seed(tokens)
    tainted = held_block_ids(tokens, 16, Taint(3, 42))
    assert tainted[:3] == clean[:3] and all(a != b for a, b in zip(tainted[3:], clean[3:], strict=True))
    assert tainted != held_block_ids(tokens, 16, Taint(3, 43))  # other garbage, other ids
    assert first_mismatch(tainted, clean) == 3 and first_mismatch(clean, clean) is None
    assert first_mismatch(clean[:4], clean) == 4


@pytest.mark.parametrize("other", [False, True])
def test_a_decode_given_another_prompts_kv_is_tainted_where_they_differ(other: bool) -> None:
    prompt = list(range(100))
    source = list(prompt)
    if other:
        source[40] += 1  # differs from block 2 on
    ids = content_block_ids(source, 16)
    taint = received_taint(RemoteKv(ids[-1], tuple(ids)), prompt, 16)
    assert taint == (Taint(2, ids[-1]) if other else None)
