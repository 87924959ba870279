"""The simulator's decode timing under routing, what a pull decision means, and which pulls exist.

* A request routed to a decode instance while a stream decodes there must not delay that stream:
  routing changes the gateway's view of the instance, not its batch.
* `Decision.pull_tokens` is what the prefill pulls *beyond its own prefix* (conductor.core.types);
  the simulator credits exactly that, and kvcache_aware's planned pulls are what gets pulled.
* Pulls happen only over a mechanism the simulated cluster has (`SimConfig.pull`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from conductor.core.types import ClusterSnapshot, Decision, Observation, Policy, RequestView, Slo
from policies.kvcache_aware import KvCacheAwarePolicy
from traces.formats import TraceRequest
from traces.sim.config import SimConfig
from traces.sim.engine import simulate
from traces.sim.runner import PolicySpec, build_policy
from traces.sim.truth import fit_truth

Route = Callable[[RequestView, ClusterSnapshot], Decision]


class Recording:
    """Routes by a function (or delegates to a real policy) and keeps what it decided and saw."""

    name = "recording"

    def __init__(self, route: Route | None = None, inner: Policy | None = None) -> None:
        self.route = route
        self.inner = inner
        self.decided: list[tuple[RequestView, Decision]] = []
        self.observed: dict[str, Observation] = {}

    def decide(self, request: RequestView, cluster: ClusterSnapshot) -> Decision:
        if self.inner is not None:
            return self.inner.decide(request, cluster)
        assert self.route is not None
        return self.route(request, cluster)

    def on_decided(self, request: RequestView, cluster: ClusterSnapshot, decision: Decision) -> None:
        self.decided.append((request, decision))
        if self.inner is not None:
            self.inner.on_decided(request, cluster, decision)

    def observe(self, observation: Observation) -> None:
        self.observed[observation.request_id] = observation
        if self.inner is not None:
            self.inner.observe(observation)


def req(t: float, n: int, out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(arrival_s=t, input_length=n, output_length=out, hash_ids=ids, line=1)


def cfg(p: int = 1, d: int = 1, **kw: object) -> SimConfig:
    base = SimConfig(p, d, truth=fit_truth(), noise=0.0, slo=Slo(ttft_s=60.0, tbt_s=0.1))
    return replace(base, **kw)  # type: ignore[arg-type]


# ---- decode timing --------------------------------------------------------------------------


def test_routing_a_request_to_a_decode_does_not_stall_its_stream() -> None:
    # A decodes alone on decode-0; B is routed there at 0.5 s (mid-stream of A) but reaches decode
    # only after A's stream should be over. A must finish when the model says, not when B arrives.
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        return Decision(r.request_id, "s", prefill=f"prefill-{r.seq}", decode="decode-0")

    c = cfg(p=2)
    t = c.truth
    pol = Recording(route)
    res = simulate(pol, [req(0.0, 1000, 51, (1, 2)), req(0.5, 60_000, 2, tuple(range(10, 128)))], c)
    a, b = pol.observed["r0"], pol.observed["r1"]
    tbt = t.decode.tbt_s(1, 1000)
    assert a.ttft_s is not None and b.ttft_s is not None
    a_done = a.ttft_s + 50 * tbt
    assert 0.5 < a_done < 0.5 + b.ttft_s  # the setting: B is routed mid-stream, decodes after A is done
    assert a.token_intervals_s == pytest.approx((tbt,) * 50, rel=1e-9)
    assert b.decode_batch == 0  # A had left when B joined
    assert res.completed == 2


# ---- what pull_tokens means -----------------------------------------------------------------


def test_pull_tokens_are_pulled_beyond_the_local_prefix() -> None:
    # prefill-1 holds 1 block of the prompt, prefill-0 all 4: a decision to pull the other 3 blocks
    # (1536 tokens) from prefill-0 credits 1536 pulled tokens on top of 512 local ones
    blocks = (1, 2, 3, 4)

    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq == 0:
            return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")
        if r.seq == 1:
            return Decision(r.request_id, "s", prefill="prefill-1", decode="decode-0")
        local = r.cached["prefill-1"].tokens
        extra = r.cached["prefill-0"].tokens - local
        return Decision(r.request_id, "s", prefill="prefill-1", decode="decode-0", pull_from="prefill-0", pull_tokens=extra)

    pol = Recording(route)
    trace = [req(0.0, 2048, 2, blocks), req(5.0, 600, 2, (1, 99)), req(10.0, 2500, 2, (*blocks, 5))]
    res = simulate(pol, trace, cfg(p=2))
    view, decision = pol.decided[2]
    assert view.cached["prefill-1"].tokens == 512 and decision.pull_tokens == 1536
    assert pol.observed["r2"].cached_tokens == 2048  # 512 local + 1536 pulled
    total = 2048 + 600 + 2500
    assert res.prefix_hit_remote == pytest.approx(1536 / total)
    assert res.prefix_hit_local == pytest.approx(512 / total)


def test_a_pull_takes_its_transfer_time_before_the_prefill() -> None:
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq == 0:
            return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")
        return Decision(r.request_id, "s", prefill="prefill-1", decode="decode-0", pull_from="prefill-0", pull_tokens=1024)

    c = cfg(p=2)
    pol = Recording(route)
    simulate(pol, [req(0.0, 1024, 2, (1, 2)), req(5.0, 1500, 2, (1, 2, 3))], c)
    t = c.truth
    assert pol.observed["r1"].queue_and_prefill_s == pytest.approx(t.transfer_s(1024) + t.prefill_s(476, 1024))


def test_pulls_from_one_holder_queue_on_its_outbound_link() -> None:
    """prefill-1 and prefill-2 pull the same 2-block prefix from prefill-0 at the same moment: one
    sender, so the second pull starts when the first ends (the receivers' links are both free)."""

    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq == 0:
            return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")
        return Decision(
            r.request_id, "s", prefill=f"prefill-{r.seq}", decode=f"decode-{r.seq}", pull_from="prefill-0", pull_tokens=1024
        )

    c = cfg(p=3, d=3)
    pol = Recording(route)
    simulate(pol, [req(0.0, 1024, 2, (1, 2)), req(5.0, 1500, 2, (1, 2, 3)), req(5.0, 1500, 2, (1, 2, 4))], c)
    t = c.truth
    pull, prefill = t.transfer_s(1024), t.prefill_s(476, 1024)
    first, second = pol.observed["r1"].queue_and_prefill_s, pol.observed["r2"].queue_and_prefill_s
    assert first == pytest.approx(pull + prefill)
    assert second == pytest.approx(2 * pull + prefill)


def test_a_handoff_waits_for_its_prefills_outbound_link() -> None:
    """A pull from prefill-0 that is still on the wire when prefill-0 finishes its own prefill
    delays that prefill's P -> D handoff, and so its first token, by what is left of the pull."""
    big = tuple(range(1, 121))  # 60K tokens: a pull long enough to outlast a short prefill

    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq in (0, 2):
            return Decision(r.request_id, "s", prefill="prefill-0", decode=f"decode-{r.seq // 2}")
        return Decision(r.request_id, "s", prefill="prefill-1", decode="decode-1", pull_from="prefill-0", pull_tokens=60_000)

    c = cfg(p=2, d=2)
    t = c.truth
    pol = Recording(route)
    trace = [req(0.0, 61_440, 2, big), req(100.0, 61_500, 2, (*big, 500)), req(100.0, 200, 2, (900,))]
    simulate(pol, trace, c)
    pull_end = 100.0 + t.transfer_s(60_000)
    short = pol.observed["r2"]
    assert short.queue_and_prefill_s is not None and short.ttft_s is not None
    assert 100.0 + short.queue_and_prefill_s < pull_end  # the setting: its prefill ends mid-pull
    handoff_start = pull_end
    first_token = handoff_start + t.transfer_s(200) + t.decode.tbt_s(1, 200)
    assert 100.0 + short.ttft_s == pytest.approx(first_token)


@pytest.mark.parametrize("handoff", ["whole", "layerwise"])
def test_a_layerwise_handoff_leaves_only_the_last_layer_after_the_prefill(handoff: str) -> None:
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")

    c = cfg(kv_handoff=handoff, kv_layers=4)
    t = c.truth
    pol = Recording(route)
    n = 20_000
    simulate(pol, [req(0.0, n, 2, tuple(range(1, 41)))], c)
    o = pol.observed["r0"]
    prefill = t.prefill_s(n, 0)
    assert o.queue_and_prefill_s == pytest.approx(prefill)
    if handoff == "whole":
        arrive = prefill + t.transfer_s(n)
    else:  # streamed from the prefill's start; the last of 4 layers follows it
        arrive = max(prefill + t.transfer_s(n // 4), t.transfer_s(n))
        assert arrive < prefill + t.transfer_s(n) - 0.5 * t.transfer_s(n)  # the setting: most of it overlapped
    assert o.ttft_s == pytest.approx(arrive + t.decode.tbt_s(1, n))


def tool_agent_trace(sessions: int = 24, turns: int = 5) -> list[TraceRequest]:
    """Agent sessions over a shared 4-block system prompt, each turn extending its own history by
    2 blocks: any instance holds the system prompt, only some hold a session's history."""
    out = []
    for s in range(sessions):
        history: tuple[int, ...] = (1, 2, 3, 4)
        for k in range(turns):
            history = (*history, 1000 * (s + 1) + 2 * k, 1000 * (s + 1) + 2 * k + 1)
            out.append(req(0.4 * s + 2.5 * k, len(history) * 512 - 100, 30, history))
    return sorted(out, key=lambda r: r.arrival_s)


def test_kvcache_aware_pulls_are_credited_in_full() -> None:
    c = cfg(p=4, d=2, truth=fit_truth(prefill_scale=7.0))
    pol = Recording(inner=build_policy(PolicySpec("kvcache_aware", {"admission": "none"}), c))
    res = simulate(pol, tool_agent_trace(), c)
    pulls = [(v, d) for v, d in pol.decided if d.pull_tokens > 0]
    beyond_local = [(v, d) for v, d in pulls if d.prefill in v.cached]
    assert len(beyond_local) >= 5  # the setting: pulls on top of a local prefix (the system prompt)
    planned = sum(d.pull_tokens for _, d in pulls)
    prompt = sum(r.input_length for r in tool_agent_trace())
    credited = res.prefix_hit_remote * prompt
    # all of it, but for pulls whose prefill instance cached more of the prompt meanwhile
    assert 0.95 * planned <= credited <= planned + 1e-6
    for view, d in beyond_local:  # and each such request reused its local prefix plus the pull
        assert pol.observed[view.request_id].cached_tokens == min(
            view.cached[d.prefill or ""].tokens + d.pull_tokens, view.prompt_tokens - 1
        )


# ---- which pulls exist ----------------------------------------------------------------------


def _peer_pull(r: RequestView, c: ClusterSnapshot) -> Decision:
    if r.seq == 0:
        return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")
    return Decision(r.request_id, "s", prefill="prefill-1", decode="decode-0", pull_from="prefill-0", pull_tokens=1024)


@pytest.mark.parametrize(("mode", "pulled"), [("both", True), ("peer", True), ("store", False), ("none", False)])
def test_the_engine_pulls_only_over_a_configured_mechanism(mode: str, pulled: bool) -> None:
    res = simulate(Recording(_peer_pull), [req(0.0, 1024, 2, (1, 2)), req(5.0, 1500, 2, (1, 2, 3))], cfg(p=2, pull=mode))
    assert (res.prefix_hit_remote > 0) is pulled
    assert res.extra["refused_pulls"] == (0.0 if pulled else 1.0)
    assert res.extra["peer_pulls"] == (1.0 if mode in ("both", "peer") else 0.0)  # the second request's


def test_the_pull_setting_reaches_kvcache_aware() -> None:
    trace = tool_agent_trace()
    c = cfg(p=4, d=2, truth=fit_truth(prefill_scale=7.0))
    for mode, pulls in (("none", False), ("store", False), ("peer", True)):
        pol = build_policy(PolicySpec("kvcache_aware", {"admission": "none"}), replace(c, pull=mode))
        assert isinstance(pol, KvCacheAwarePolicy)
        res = simulate(pol, trace, replace(c, pull=mode))
        assert (res.prefix_hit_remote > 0) is pulls, mode
        assert res.extra["refused_pulls"] == 0  # it asked for none the cluster cannot do
    explicit = build_policy(PolicySpec("kvcache_aware", {"allow_pull": False}), c)
    assert isinstance(explicit, KvCacheAwarePolicy) and not explicit.allow_pull  # a spec's own option wins


def test_sim_config_rejects_an_unknown_pull_mode() -> None:
    with pytest.raises(ValueError, match="pull must be one of"):
        cfg(pull="rdma")


def test_the_simulator_lists_only_the_chosen_candidates_unless_told() -> None:
    """Nothing in a simulation logs a decision's candidates, so build_policy asks kvcache_aware for
    the chosen ones only; a spec's own `listed_candidates` wins, and the decisions are the same."""
    trace = tool_agent_trace()
    c = cfg(p=4, d=2, truth=fit_truth(prefill_scale=7.0))
    quick = build_policy(PolicySpec("kvcache_aware", {"admission": "none"}), c)
    listed = build_policy(PolicySpec("kvcache_aware", {"admission": "none", "listed_candidates": 8}), c)
    assert isinstance(quick, KvCacheAwarePolicy) and isinstance(listed, KvCacheAwarePolicy)
    assert (quick.listed_candidates, listed.listed_candidates) == (1, 8)
    a, b = simulate(quick, trace, c), simulate(listed, trace, c)
    assert (a.goodput_rps, a.ttft, a.prefix_hit_remote) == (b.goodput_rps, b.ttft, b.prefix_hit_remote)


@pytest.mark.parametrize("name", ["dynamo_kv", "llmd", "least_loaded", "sglang_cache_aware"])
def test_the_simulator_lists_only_the_chosen_candidates_of_the_baselines_too(name: str) -> None:
    trace = tool_agent_trace()
    c = cfg(p=4, d=2, truth=fit_truth(prefill_scale=7.0))
    quick = build_policy(PolicySpec(name), c)
    every = build_policy(PolicySpec(name, {"listed_candidates": None}), c)
    assert (vars(quick)["listed_candidates"], vars(every)["listed_candidates"]) == (1, None)
    a, b = simulate(quick, trace, c), simulate(every, trace, c)
    assert (a.goodput_rps, a.completed, a.ttft, a.tbt, a.prefix_hit_local) == (
        b.goodput_rps,
        b.completed,
        b.ttft,
        b.tbt,
        b.prefix_hit_local,
    )


@pytest.mark.parametrize(
    ("change", "message"), [({"kv_handoff": "pipelined"}, "kv_handoff must be one of"), ({"kv_layers": 0}, "kv_layers must be")]
)
def test_sim_config_rejects_an_unknown_handoff(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cfg(**change)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["peer", "staged", "staged-fcfs"])
def test_a_staged_pull_waits_for_its_holder(mode: str) -> None:
    # prefill-0 holds a 1024-token prefix (r0), then runs a long prefill (r1) with another queued
    # behind it (r2); r3 goes to prefill-1 pulling the prefix. A direct peer read starts at once; a
    # staging request with priority waits for r1; one in FCFS order for r1 and r2 too
    def route(r: RequestView, c: ClusterSnapshot) -> Decision:
        if r.seq < 3:
            return Decision(r.request_id, "s", prefill="prefill-0", decode="decode-0")
        return Decision(r.request_id, "s", prefill="prefill-1", decode="decode-0", pull_from="prefill-0", pull_tokens=1024)

    c = cfg(p=2, pull=mode)
    t = c.truth
    pol = Recording(route)
    trace = [
        req(0.0, 1024, 2, (1, 2)),
        req(5.0, 20_000, 2, tuple(range(10, 50))),
        req(5.05, 8_000, 2, tuple(range(60, 76))),
        req(5.1, 1500, 2, (1, 2, 3)),
    ]
    simulate(pol, trace, c)
    view = pol.decided[3][0]
    assert view.queued_pull_sources == (frozenset() if mode == "peer" else {"prefill-0", "prefill-1"})
    assert view.staging_jumps_queue is (mode == "staged")
    r1_end = 5.0 + t.prefill_s(20_000, 0)
    staged = {
        "peer": 5.1,
        "staged": r1_end + t.prefill_s(1, 1024),
        "staged-fcfs": r1_end + t.prefill_s(8_000, 0) + t.prefill_s(1, 1024),
    }[mode]
    leg = pol.observed["r3"].queue_and_prefill_s
    assert leg == pytest.approx(staged - 5.1 + t.transfer_s(1024) + t.prefill_s(476, 1024))
