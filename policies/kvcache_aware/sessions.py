"""Session affinity: a session's turns, and an agent's parallel calls, kept on the instances that served it.

The cache index sees a prefix once the worker reports it (KV events), the in-flight table once the
gateway dispatched it (inflight.py), and only as far as the gateway's block keys match: with the index
off, a prompt whose beginning changes between turns (a rewritten system prompt, a compacted history)
or a prefix evicted from the index's view while the worker keeps it, the session's own instance is the
best guess of where its KV is. A request naming a session (`RequestView.session`) is therefore placed
on the prefill instance that served the session's last turn when its predicted TTFT is within
`session_slack` of the best instance's (a share of the TTFT SLO; without one, of the best's TTFT),
and on the decode that served it when that decode's TBT now is within `session_decode_slack` of the
lowest: vLLM's NIXL decode computes only the blocks it lacks (its own prefix cache counts), and a
NIXL decode's readback of the last turn is held there. Admission then judges that placement; if it
would miss an SLO while the policy's own choice would not, the session moves to the policy's choice
and is remembered there.

`SessionTable` is the policy's memory of sessions: session -> (prefill, decode) of its last admitted
turn, a bounded LRU (`max_sessions`), changed only from the policy's `on_decided`. Each decision of
a request with a session marks its chosen candidates' detail `session_affinity` (the decision log
shows it): 1 kept on the session's instance over a faster one, 0 the session's instance was the
policy's choice anyway, -1 moved (its instance missed the slack or the SLO, or is gone).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from types import MappingProxyType

from conductor.core.types import CandidateScore, Decision, InstanceView, RequestView
from policies.base import listed_indices
from policies.estimate import DecodeEstimate, decode_loads_now
from policies.kvcache_aware.options import SessionOptions
from policies.kvcache_aware.placement import Placement
from policies.kvcache_aware.pool_estimates import PoolPrefillEstimates
from predictors.online import Predictors

DETAIL = "session_affinity"
KEPT, AGREED, MOVED = 1.0, 0.0, -1.0
Marks = tuple[float, float | None]  # the prefill's mark, the decode's (None: no decode to keep)


class SessionTable:
    """session -> (prefill, decode) of its last admitted turn; at most `max_sessions`, least recent out first."""

    __slots__ = ("_last", "counts", "max_sessions")

    def __init__(self, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, not {max_sessions!r}")
        self.max_sessions = max_sessions
        self._last: OrderedDict[int, tuple[str, str | None]] = OrderedDict()
        # admitted decisions with a session by (role, mark): what the simulator reports to say whether
        # affinity changed anything; ("", None) counts the sessions' first turns
        self.counts: dict[tuple[str, float | None], int] = {}

    def __len__(self) -> int:
        return len(self._last)

    def last(self, session: int) -> tuple[str, str | None] | None:
        return self._last.get(session)

    def remember(self, request: RequestView, decision: Decision) -> None:
        """An admitted decision of a request with a session: its instances are the session's now."""
        session = request.session
        if session is None or decision.prefill is None:
            return
        for key in _outcomes(decision):
            self.counts[key] = self.counts.get(key, 0) + 1
        last = self._last
        last[session] = (decision.prefill, decision.decode)
        last.move_to_end(session)
        if len(last) > self.max_sessions:
            last.popitem(last=False)


def _outcomes(decision: Decision) -> list[tuple[str, float | None]]:
    """(role, mark) of the decision's marked candidates; [("", None)] for a session's first turn."""
    marks: list[tuple[str, float | None]] = [(c.role.value, c.detail[DETAIL]) for c in decision.candidates if DETAIL in c.detail]
    return marks or [("", None)]


def _index(ids: list[str], instance_id: str | None) -> int | None:
    try:
        return ids.index(instance_id)  # type: ignore[arg-type]
    except ValueError:
        return None


def prefer_session(
    pred: Predictors,
    request: RequestView,
    last: tuple[str, str | None],
    decodes: tuple[InstanceView, ...],
    weighed: PoolPrefillEstimates,
    placed: Placement,
    options: SessionOptions,
    listed: int | None,
) -> tuple[Placement, Marks]:
    """`placed` moved onto the session's last instances where their predictions allow (see the
    module docstring), and its mark: KEPT (moved onto one of them at least), AGREED (the policy
    chose them anyway) or MOVED, for the prefill and for the decode. Admission has yet to judge the
    placement returned."""
    prefill_id, decode_id = last
    ttfts, best = weighed.ttfts, placed.best
    i = _index([p.id for p in weighed.prefills], prefill_id)  # None: gone (unhealthy, failed over, left)
    slo = request.slo.ttft_s
    slack = options.slack * (slo if slo is not None else ttfts[best])
    steered, mark = placed, (MOVED if i is None or ttfts[i] > ttfts[best] + slack else AGREED if i == best else KEPT)
    if i is not None and mark == KEPT:
        steered = replace(placed, best=i, listed=listed_indices(ttfts, listed, i))
    tbts = placed.decode_tbts
    if tbts is None or decode_id is None:
        return steered, (mark, None)
    if decode_id == placed.decode.instance.id:
        return steered, (mark, AGREED)
    ids = [d.id for d in decodes]
    j, now = _index(ids, decode_id), ids.index(placed.decode.instance.id)
    if j is None or tbts[j] > tbts[now] * (1.0 + options.decode_slack):
        return steered, (mark, MOVED)  # that decode is gone or loaded beyond the slack
    (tbt,), (batch,), (kv,) = decode_loads_now(pred, request, (decodes[j],))
    chosen = DecodeEstimate(decodes[j], tbt, batch, kv, 0.0)
    listed_decodes = sorted(
        [*(d for d in placed.decodes_listed if d.instance.id != decode_id), chosen], key=lambda d: ids.index(d.instance.id)
    )
    return replace(steered, decode=chosen, decodes_listed=listed_decodes), (mark, KEPT)


def mark_session(decision: Decision, marks: Marks) -> Decision:
    """The decision with its chosen prefill's and decode's candidates marked `session_affinity`."""
    prefill, decode = marks
    chosen: dict[str | None, float | None] = {decision.prefill: prefill}
    chosen[decision.decode] = decode
    if decision.prefilled_on_decode:
        chosen = {decision.decode: decode}
    candidates = tuple(
        _marked(c, chosen[c.instance_id]) if chosen.get(c.instance_id) is not None else c for c in decision.candidates
    )
    return replace(decision, candidates=candidates)


def _marked(c: CandidateScore, mark: float | None) -> CandidateScore:
    assert mark is not None  # mark_session marks only the candidates it has a mark for
    return replace(c, detail=MappingProxyType({**c.detail, DETAIL: mark}))
