"""The gateway carries out a prefill-to-prefill pull (conductor/routing/peer_pull.py) on emulated workers.

Two bidirectional NIXL prefills with KV events and a bidirectional decode. One prefill holds a
prompt's prefix; the policy sends a longer prompt to the other one and pulls from the holder. The
gateway stages the prefix on the holder (a one-token request that pins its blocks), hands the
target the holder's block ids, and the target reads them over the holder's side channel. The
emulated KV carries its content (adapters/emulator/kv_content.py): a wrong pull would change the
answer's text, so the text equal to a mixed engine's says the pull was right, and the target's
reported cached tokens equal to the prediction say the index and the pull agree.

The policy here is a scripted one (it always goes away from the holder): what is under test is
that the gateway carries out the pull the decision plans. Stand-ins cover the failure paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.core.types import ClusterSnapshot, Decision, RequestView, Role
from conductor.gateway import Gateway
from policies.base import BasePolicy, no_instance
from tests.conductor.routing.test_readback_gateway import cached_counters, holders, index_holders
from tests.support.cluster import cluster
from tests.support.emulator import Emulator, start_emulator
from tests.support.servers import ServerThread, serve_gateway
from tests.support.waiting import wait_for

BLOCK = 16
COMMON: dict[str, Any] = {"time_scale": 0.01, "block_size": BLOCK, "noise": 0.0, "model": "tiny"}


class AwayFromTheHolder(BasePolicy):
    """Every request to the first prefill that is not a pull source of it, pulling from the first
    source that needs staging (to the holder, without a pull, when it is the only prefill left);
    what the gateway offered is kept for the test to read."""

    name = "away_from_the_holder"

    def __init__(self) -> None:
        self.views: list[RequestView] = []

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        self.views.append(request)
        sources = request.pull_sources or {}
        holder = next((iid for iid in sources if iid in request.queued_pull_sources), None)
        prefills = [p.id for p in cluster.by_role(Role.PREFILL)]
        decodes = cluster.by_role(Role.DECODE)
        # a failover excludes what failed: with no decode (or no prefill) left, the request ends
        # as any policy ends it there (a 503), not as this script's IndexError (a 500)
        if not decodes or not prefills:
            return no_instance(request, self.name, Role.DECODE if not decodes else Role.PREFILL)
        # after a failover the other prefill may be excluded: then the holder computes it, no pull
        target = next((iid for iid in prefills if iid != holder), None)
        if target is None:
            target, holder = prefills[0], None
        return Decision(
            request.request_id,
            self.name,
            prefill=target,
            decode=decodes[0].id,
            pull_from=holder,
            pull_tokens=sources.get(holder, 0) if holder else 0,
            predicted_ttft_s=0.05,
        )


@dataclass
class Setup:
    url: str
    gateway: Gateway
    server: ServerThread
    prefills: list[Emulator]
    decode: Emulator
    mixed: Emulator
    policy: AwayFromTheHolder


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    with ExitStack() as stack:
        prefills = [
            stack.enter_context(
                start_emulator(
                    "prefill", "nixl", kv_events=True, bidirectional_kv_xfer=True, scheduling_policy="priority", **COMMON
                )
            )
            for _ in range(2)
        ]
        decode = stack.enter_context(start_emulator("decode", "nixl", bidirectional_kv_xfer=True, **COMMON))
        mixed = stack.enter_context(start_emulator("mixed", "nixl", **COMMON))
        settings = load_settings(
            environ={},
            overrides={
                "block_size": BLOCK,
                "health": {"interval_s": 0.5},
                "prefill": [
                    {"url": p.url, "kv_events_endpoint": "tcp://*:" + str(p.kv_events_endpoint).rsplit(":", 1)[1]}
                    for p in prefills
                ],
                "decode": [decode.url],
                # the built-in tokenizer is the emulators' own: its token ids are theirs
                "kv": {"enabled": True, "forward_token_ids": True},
                "pd": {"protocol": "nixl", "peer_pull": "on", "peer_pull_priority": -1},
            },
        )
        policy = AwayFromTheHolder()
        gateway = Gateway(settings, policy=policy)
        server = stack.enter_context(serve_gateway(gateway))
        yield Setup(server.url, gateway, server, prefills, decode, mixed, policy)


def post(url: str, prompt: str) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def requests_of(emu: Emulator) -> list[dict[str, Any]]:
    return list(httpx.get(emu.url + "/emulator/requests").json())


def peer_pulls(url: str, event: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'conductor_pd_peer_pull_total{{event="{event}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no conductor_pd_peer_pull_total series for {event}")


def pinned(emu: Emulator) -> int:
    return int(httpx.get(emu.url + "/emulator/state").json()["pinned_for_readback"])


def test_a_prefix_one_prefill_holds_is_pulled_into_the_other(setup: Setup) -> None:
    s = setup
    holder, target = s.prefills
    system = "You are the support agent of a large shop; answer in two sentences. " * 45  # 3,060 bytes
    post(s.url, system)  # no holder yet: the policy sends it to the first prefill
    assert wait_for(lambda: holders(s, system).get("prefill-0", 0) >= len(system) // BLOCK, 10.0), holders(s, system)
    assert not holders(s, system).get("prefill-1")

    prompt = system + "Where is my parcel?"
    pulled = len(system.encode()) // BLOCK * BLOCK
    before, staged_before = cached_counters(s), peer_pulls(s.url, "staged")
    answer = post(s.url, prompt)
    view = s.policy.views[-1]
    # the decode that served the first prompt holds its KV too (a readback: no staging needed)
    assert view.pull_sources == {"prefill-0": pulled, "decode-0": pulled}
    assert view.queued_pull_sources == {"prefill-0"}
    assert view.staging_jumps_queue

    # the staging request: the prefix's token ids and one more, one token, a P/D prefill's params
    stage = requests_of(holder)[-1]
    assert stage["headers"]["x-request-id"].endswith("-stage")
    body = stage["body"]
    assert len(body["prompt"]) == pulled + 1 and body["max_tokens"] == 1 and body["priority"] == -1
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    # the target got the holder's blocks to pull, and pulled exactly the prefix
    leg = next(r for r in reversed(requests_of(target)) if r["body"].get("prompt") != body["prompt"])
    params = leg["body"]["kv_transfer_params"]
    assert params["remote_engine_id"] == holder.engine_id and params["remote_num_tokens"] == pulled
    assert len(params["remote_block_ids"][0]) == pulled // BLOCK
    (modelled,) = leg["modelled"]
    assert modelled["external_tokens"] == pulled and modelled["transfer_s"] > 0
    # the target reports as cached what the index predicted, and the read freed the holder's pin
    assert wait_for(lambda: cached_counters(s) != before, 5.0)
    after = cached_counters(s)
    assert (after[0] - before[0], after[1] - before[1]) == (pulled, pulled)
    assert peer_pulls(s.url, "staged") == staged_before + 1
    assert wait_for(lambda: pinned(holder) == 0, 5.0)
    alone = httpx.post(
        s.mixed.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    ).json()
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_short_shared_prefix_is_not_staged(setup: Setup) -> None:
    s = setup
    head = "Short shared head. " * 2  # 38 bytes: 2 blocks, under pd_pull_min_tokens (64)
    post(s.url, head + "first question about something long enough to fill blocks " * 3)
    assert wait_for(lambda: holders(s, head), 10.0)
    views = len(s.policy.views)
    post(s.url, head + "a different question entirely, with its own words " * 3)
    assert s.policy.views[views].pull_sources == {}


def test_a_staging_answer_without_usable_blocks_leaves_the_prefill_to_compute() -> None:
    # stand-ins answer remote_block_ids as a flat list, no layout a pull can name
    policy = AwayFromTheHolder()
    with cluster(
        "nixl",
        n_prefill=2,
        n_decode=1,
        policy=policy,
        block_size=BLOCK,
        pd={"peer_pull": "on"},
        kv={"enabled": True, "forward_token_ids": True},
    ) as c:
        prompt = "Tell me about the weather in Lisbon in spring. " * 10
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": prompt}).status_code == 200
        # the index records a dispatch beside the request: on a starved box the next request can
        # come first (a CI run saw no pull source offered), so wait for the holder as the others do
        assert wait_for(lambda: index_holders(c.gateway, c.servers["gateway"], prompt).get("prefill-0", 0) > 0, 10.0)
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": prompt + "And autumn?"})
        assert r.status_code == 200, r.text
        assert policy.views[-1].queued_pull_sources == {"prefill-0"}
        (stage,) = [r.body for r in c.prefills[0].requests if r.headers["x-request-id"].endswith("-stage")]
        assert stage["kv_transfer_params"]["do_remote_decode"] is True and "priority" not in stage
        target = c.prefills[1].bodies()[-1]
        assert not target["kv_transfer_params"].get("remote_block_ids")
        metrics = httpx.get(c.url + "/metrics").text
        assert 'conductor_pd_peer_pull_total{event="stage_failed"} 1.0' in metrics
        assert 'conductor_pd_peer_pull_total{event="staged"} 0.0' in metrics


def test_a_failing_holder_fails_the_staging_not_the_request() -> None:
    policy = AwayFromTheHolder()
    with cluster(
        "nixl",
        n_prefill=2,
        n_decode=1,
        policy=policy,
        block_size=BLOCK,
        pd={"peer_pull": "on"},
        kv={"enabled": True, "forward_token_ids": True},
    ) as c:
        prompt = "Summarise the incident report for the on-call engineer. " * 8
        assert httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": prompt}).status_code == 200
        assert wait_for(lambda: index_holders(c.gateway, c.servers["gateway"], prompt).get("prefill-0", 0) > 0, 10.0)
        c.prefills[0].fail_status = 503  # the holder now fails everything
        r = httpx.post(c.url + "/v1/completions", json={"model": "tiny", "prompt": prompt + "Briefly."})
        assert r.status_code == 200, r.text
        target = c.prefills[1].bodies()[-1]
        assert len(target["prompt"]) > len(prompt) and not target["kv_transfer_params"].get("remote_block_ids")
        metrics = httpx.get(c.url + "/metrics").text
        assert 'conductor_pd_peer_pull_total{event="stage_failed"} 1.0' in metrics


def test_peer_pull_on_without_the_workers_token_ids_fails_start_up() -> None:
    from conductor.core.errors import ConfigError

    settings = load_settings(
        environ={},
        overrides={
            "pd": {"protocol": "nixl", "peer_pull": "on"},
            "prefill": ["http://127.0.0.1:1"],
            "decode": ["http://127.0.0.1:2"],
            "kv": {"enabled": True},
        },
    )
    with pytest.raises(ConfigError, match="token ids"):
        Gateway(settings)
