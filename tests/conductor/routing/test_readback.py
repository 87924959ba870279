"""The decode readback table: which handle a new prompt may pull, once, while it lives, within bounds."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.routing.readback import Handle, ReadbackTable, parse_decode_params, pull_sources, pull_tokens_for


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def decode_params(blocks: int = 10, **changes: Any) -> dict[str, Any]:
    """A bidirectional decode's answer params, as vLLM 0.32 wrote them in a real run."""
    params: dict[str, Any] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(range(1, blocks + 1))],
        "remote_engine_id": "39844e1a",
        "remote_request_id": "cmpl-979be07c-0",
        "remote_host": "localhost",
        "remote_port": 50053,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 308,
        "remote_blocks_expiry_time": 1462.68,
        "transfer_mode": "pull",
    }
    params.update(changes)
    return params


def handle(instance: str = "d0", prompt_blocks: int = 9, now: float = 100.0, **changes: Any) -> Handle:
    h = parse_decode_params(instance, decode_params(**changes), prompt_blocks, now)
    assert h is not None
    return h


def test_a_decode_answer_becomes_a_handle_covering_the_prompt_blocks_only() -> None:
    h = handle(prompt_blocks=9)  # 10 blocks pinned (prompt + answer), 9 full prompt blocks
    assert (h.instance, h.prompt_blocks, list(h.block_ids)) == ("d0", 9, list(range(1, 10)))
    assert h.params(4, 32) == {
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "39844e1a",
        "remote_request_id": "cmpl-979be07c-0",
        "remote_host": "localhost",
        "remote_port": 50053,
        "tp_size": 1,
        "remote_num_tokens": 128,
    }


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "x",
        {},
        decode_params(do_remote_decode=False),
        decode_params(remote_block_ids=[[1, 2], [3, 4]]),
        decode_params(remote_block_ids="1,2"),
        decode_params(remote_port="50053"),
        decode_params(remote_port=0),
        decode_params(remote_host=None),
        decode_params(remote_block_ids=[[-1, 2]]),
        decode_params(pp_size=2),
        decode_params(remote_block_ids=[[]]),
    ],
)
def test_anything_else_is_not_a_readback_offer(bad: Any) -> None:
    assert parse_decode_params("d0", bad, 9, 0.0) is None


def test_a_prompt_gets_the_handle_sharing_its_longest_prefix_and_takes_it_once() -> None:
    table = ReadbackTable(ttl_s=60, clock=Clock())
    turn1 = (11, 12, 13)  # block keys of the last turn's prompt
    table.record(turn1, handle(prompt_blocks=3))
    table.record((11, 77), handle("d1", prompt_blocks=2))  # shares one block with turn 2
    offer = table.offer((11, 12, 13, 14, 15))  # the next turn: the same 3 blocks, then more
    assert offer is not None and (offer.handle.instance, offer.blocks) == ("d0", 3)
    assert table.offer((99, 98, 97)) is None  # another first block: every chained key differs
    assert table.offer((12, 13)) is None  # a key at another depth than it was filed at
    assert table.take(offer) is offer.handle
    assert table.take(offer) is None  # served once
    assert table.offer((11, 12, 13, 14)) is None
    assert table.taken == 1 and len(table) == 1


def test_unusable_decodes_and_old_handles_are_not_offered() -> None:
    clock = Clock()
    table = ReadbackTable(ttl_s=60, clock=clock)
    table.record((1, 2), handle("d0", prompt_blocks=2, now=clock.t))
    assert table.offer((1, 2, 3), usable=lambda name: name != "d0") is None
    assert table.offer((1, 2, 3)) is not None
    clock.t += 61
    assert table.offer((1, 2, 3)) is None
    assert table.expired == 1 and len(table) == 0 and table.block_ids_held == 0


def test_the_table_is_bounded_in_handles_and_block_ids() -> None:
    table = ReadbackTable(ttl_s=60, max_handles=3, max_block_ids=20, clock=Clock())
    for i in range(5):
        table.record((1000 + i,), handle(f"d{i}", prompt_blocks=1))
    assert len(table) == 3 and table.evicted == 2
    assert table.offer((1000,)) is None and table.offer((1004,)) is not None  # oldest went first
    table.record(tuple(range(9)), handle("big", prompt_blocks=9))
    table.record(tuple(range(50, 59)), handle("big2", prompt_blocks=9))
    assert table.block_ids_held <= 20
    assert table.offer(tuple(range(50, 59))) is not None


def test_a_restarted_decode_takes_its_handles_with_it() -> None:
    table = ReadbackTable(ttl_s=60, clock=Clock())
    table.record((1,), handle("d0", prompt_blocks=1))
    table.record((2,), handle("d1", prompt_blocks=1))
    table.forget_instance("d0")
    assert table.offer((1,)) is None and table.offer((2,)) is not None


def test_the_pull_never_covers_the_last_prompt_token() -> None:
    table = ReadbackTable(ttl_s=60, clock=Clock())
    table.record((1, 2, 3), handle(prompt_blocks=3))
    offer = table.offer((1, 2, 3))
    assert offer is not None
    # 96 tokens = exactly 3 blocks: the prefill must compute the last token, so 2 blocks are pulled
    assert pull_tokens_for(offer, 96, 32) == 64
    assert pull_tokens_for(offer, 97, 32) == 96
    assert pull_sources(offer, 97, 32) == {"d0": 96}
    assert pull_sources(offer, 20, 32) == {} and pull_sources(None, 97, 32) == {}
