"""Prefill-to-prefill pulls: a prefill that lacks a prefix another prefill holds reads it over NIXL.

With stock vLLM (0.32's NixlConnector, `bidirectional_kv_xfer` on every prefill) a pull is two steps:

1. Staging. The gateway sends the holder a completions request for the prefix's token ids plus the
   next one (so that its prefix cache serves every full block of the prefix and it computes one
   token), max_tokens 1, with the prefill leg's usual kv_transfer_params (`do_remote_decode`).
   Finished length-capped, the holder keeps the request's blocks pinned for its `kv_lease_duration`
   (30 s by default) and answers where they are, as it answers a decode in plain P/D:
   remote_block_ids (from position 0), remote_engine_id, remote_request_id, remote_host, remote_port.
2. The pull. The chosen prefill gets the client's request with those fields merged over its own
   do_remote_decode ones, remote_block_ids cut to the prefix's full blocks and remote_num_tokens
   their token count. A bidirectional prefill given that pulls `min(remote_num_tokens, prompt) -
   local hit` tokens when that is at least its kv_recompute_threshold (`pd_pull_min_tokens` here),
   then tells the holder to free the blocks (it does so when it pulls nothing, too).

What it costs: the staging request waits in the holder's FCFS queue like any other, so a pull
from a busy holder pays that queue, and going to the holder would be as quick. Where the prefills
run vLLM's `--scheduling-policy priority`, `pd.peer_pull_priority` (below the clients' 0) lets it
jump the queue: it waits only for the prefill running there. The gateway says which sources need
staging and how (`RequestView.queued_pull_sources`, `staging_jumps_queue`) and the policy adds
that predicted wait to the pull.

When something fails, nothing is lost: a staging request that fails, times out or answers no
usable blocks leaves the chosen prefill to compute the prefix itself (`stage_failed`); a pull that
fails on the prefill is retried without it. A prefill whose request fails before it reads leaves
the blocks to the holder's lease, which frees them. Planning, staging and the fallback are
`PullPlanner`'s (conductor/routing/pulls.py); this module holds the rules they follow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from conductor.core.types import Role, Tier
from conductor.kv.analysis import PromptAnalysis


class StagedKvParams(msgspec.Struct, forbid_unknown_fields=False):
    """The fields of a staged prefill's answer that a pull needs (types checked)."""

    remote_block_ids: list[list[int]]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1


def peer_sources(
    analysis: PromptAnalysis, holders: Mapping[str, Any], usable: Callable[[str], bool], block_size: int, min_tokens: int
) -> dict[str, int]:
    """Prefill instances a prefill could pull this prompt's prefix from: instance id -> tokens.

    `holders`: instance id -> its registry state (role and health); `usable`: also ready and not
    excluded for this request. A prefix counts in whole blocks and never reaches the prompt's last
    token (a prefill always computes that one), and only from `min_tokens` on (vLLM skips smaller
    pulls). A prefix in the pooled store is no peer's to stage."""
    out: dict[str, int] = {}
    limit = (analysis.prompt_tokens - 1) // block_size * block_size
    for iid, prefix in analysis.cached.items():
        tokens = min(prefix.tokens, limit)
        if tokens < max(min_tokens, block_size) or prefix.tier is Tier.STORE:
            continue
        state = holders.get(iid)
        if state is not None and state.spec.role is Role.PREFILL and state.healthy and usable(iid):
            out[iid] = tokens
    return out


def pull_params(answer: Any, tokens: int, block_size: int) -> dict[str, Any] | None:
    """The chosen prefill's extra kv_transfer_params that pull the first `tokens` tokens the staging
    answer pinned; None when the answer names no usable blocks (bidirectional or P/D off on the
    holder, a multi-group or multi-rank layout, too few blocks, bad types)."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not params:
        return None
    try:
        p = msgspec.convert(params, StagedKvParams)
    except (msgspec.ValidationError, TypeError):
        return None
    blocks = tokens // block_size
    if len(p.remote_block_ids) != 1 or p.dcp_size != 1 or p.pp_size != 1 or not 0 < p.remote_port < 65536:
        return None
    ids = p.remote_block_ids[0]
    if blocks <= 0 or len(ids) < blocks or any(i < 0 for i in ids[:blocks]):
        return None
    return {
        "remote_block_ids": [ids[:blocks]],
        "remote_engine_id": p.remote_engine_id,
        "remote_request_id": p.remote_request_id,
        "remote_host": p.remote_host,
        "remote_port": p.remote_port,
        "tp_size": p.tp_size,
        "remote_num_tokens": blocks * block_size,
    }
