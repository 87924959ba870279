"""Sessions: where the KV index is blind, a session's prefix is assumed on the instance that served it.

The KV-aware cost already follows a prefix the index sees (KV events) or the in-flight table holds
(inflight.py): there a session adds nothing, and keeping a turn on a slower instance only costs
TTFT (docs/kvcache_aware.md, "Sessions"). The index is blind with the KV index off, before the
worker's events arrive, or after its entry was evicted while the worker kept the blocks. A
request naming a session (`RequestView.session`) is therefore weighed with a hint: the prefill that
served the session's last turn is credited the prefix that turn left there (the leading blocks the
two prompts share, read from the turn's sampled block keys; without block keys, the shorter prompt
in whole blocks) when the index, with the in-flight table, reports less there; nothing when it
reports as much. A prompt whose start changed shares no block: the worker's prefix cache cannot
reuse it either, so it gets no hint. The hint is an input of the
normal cost model (queue + prefill of the uncached part, under the placement's TTFT slack), so the
session's instance wins only when it is predicted to, and admission judges it as any placement.

The decode: a session's decode is preferred (within `session_decode_slack` of the lowest TBT) only
where the gateway offers a readback of the last turn from it (`RequestView.pull_sources`, a NIXL
decode's pinned KV, conductor/routing/readback.py): that is the one case the gateway knows the
decode still holds the session's KV, which its NIXL handoff then does not send again. Elsewhere
(no readback, the simulator's whole-prompt handoff) the decode's cache is unknown or unused, and
a bias could only cost TBT. A session whose decode would miss an SLO the policy's own meets moves.

`SessionTable` is the policy's memory of sessions: session -> the last admitted turn's prefill,
decode, prompt tokens and SAMPLED_KEYS of its block keys (about 0.6 KB a session), a bounded LRU
(`max_sessions`), changed only from `on_decided`. The decision log marks the chosen prefill
candidate `session_hint` when the hint was given (1: it decided the placement, the session's
instance would not have been chosen without it; 0: chosen anyway; -1: placed elsewhere all the
same), and the chosen decode `session_affinity` when the readback rule applied (1 kept over a less
loaded decode, 0 the choice anyway, -1 moved).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import replace
from types import MappingProxyType
from typing import NamedTuple

from conductor.core.types import CachedPrefix, CandidateScore, Decision, InstanceView, RequestView, Role
from policies.estimate import DecodeEstimate, decode_loads_now
from policies.kvcache_aware.placement import Placement
from predictors.online import Predictors

HINT = "session_hint"  # the chosen prefill's detail: what the hint did
DETAIL = "session_affinity"  # the chosen decode's detail: what the readback rule did
DECIDED, KEPT, AGREED, MOVED = 1.0, 1.0, 0.0, -1.0
_NAMES = {(HINT, DECIDED): "prefill_decided", (HINT, AGREED): "prefill_agreed", (HINT, MOVED): "prefill_moved"}
_NAMES |= {(DETAIL, KEPT): "decode_kept", (DETAIL, AGREED): "decode_agreed", (DETAIL, MOVED): "decode_moved"}
SAMPLED_KEYS = 32  # block keys a session's last turn is remembered by (LastTurn.keys): 256 bytes
Marks = tuple[float | None, float | None]  # the prefill's hint mark, the decode's mark (None: none)


class LastTurn(NamedTuple):
    """A session's last admitted turn: where it ran, and what its prompt was (`keys`: its block keys
    at `sampled_blocks(blocks)`, None without block keys)."""

    prefill: str
    decode: str | None
    prompt_tokens: int
    blocks: int
    keys: array[int] | None

    @classmethod
    def of(cls, request: RequestView, decision: Decision) -> LastTurn:
        assert decision.prefill is not None
        keys, n = request.block_keys, len(request.block_keys)
        try:
            sampled = array("Q", [keys[i - 1] for i in sampled_blocks(n)]) if n else None
        except OverflowError:  # not 64-bit keys: the turn is remembered by its length only
            sampled = None
        return cls(decision.prefill, decision.decode, request.prompt_tokens, n, sampled)

    def shared_tokens(self, request: RequestView) -> int:
        """The leading tokens of `request` this turn's prompt left on its prefill, in whole blocks:
        the longest sampled block key the two prompts share (the keys are a hash chain: equal there,
        equal before), else, without block keys, the shorter prompt."""
        block = max(1, request.block_size)
        keys = request.block_keys
        if self.keys is None or not keys:
            return min(self.prompt_tokens, request.prompt_tokens) // block * block
        shared = 0
        for i, key in zip(sampled_blocks(self.blocks), self.keys, strict=True):
            if i > len(keys) or keys[i - 1] != key:
                break
            shared = i
        return min(shared * block, request.prompt_tokens // block * block)


def sampled_blocks(n: int) -> list[int]:
    """Up to SAMPLED_KEYS block counts, evenly spread over 1..n and ending with n, at which a turn's
    block keys are remembered: a prefix shared with a later prompt is then known exactly when it is the
    whole turn (a conversation's next turn), to n / SAMPLED_KEYS blocks below otherwise."""
    return sorted({max(1, (j + 1) * n // SAMPLED_KEYS) for j in range(SAMPLED_KEYS)})


class SessionTable:
    """session -> its LastTurn; at most `max_sessions`, least recent out first."""

    __slots__ = ("_last", "counts", "max_sessions")

    def __init__(self, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, not {max_sessions!r}")
        self.max_sessions = max_sessions
        self._last: OrderedDict[int, LastTurn] = OrderedDict()
        # admitted decisions with a session by what the session did to them (_NAMES, "first" turns,
        # "unhinted": a known session given no hint): what the simulator reports
        self.counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._last)

    def last(self, session: int) -> LastTurn | None:
        return self._last.get(session)

    def remember(self, request: RequestView, decision: Decision) -> None:
        """An admitted decision of a request with a session: its instances are the session's now."""
        session = request.session
        if session is None or decision.prefill is None:
            return
        last = self._last
        marks = [_NAMES.get((k, v)) for c in decision.candidates for k, v in c.detail.items() if k in (HINT, DETAIL)]
        self.counts.update([m for m in marks if m] or ["unhinted" if session in last else "first"])
        last[session] = LastTurn.of(request, decision)
        last.move_to_end(session)
        if len(last) > self.max_sessions:
            last.popitem(last=False)


def hinted(request: RequestView, last: LastTurn, prefills: tuple[InstanceView, ...]) -> RequestView | None:
    """`request` (its `cached` the index's and the in-flight table's) with the session's prefill
    credited the prefix its last turn left there, where they report less; None: no hint (the index
    knows, nothing to credit, or that instance is not in the pool)."""
    tokens = last.shared_tokens(request)
    if tokens <= 0 or not any(p.id == last.prefill for p in prefills):
        return None
    known = request.cached.get(last.prefill)
    if known is not None and known.tokens >= tokens:
        return None
    return replace(request, cached={**request.cached, last.prefill: CachedPrefix(tokens)})


def hint_mark(best: int, prefills: tuple[InstanceView, ...], last: LastTurn, plain_best: int | None) -> float:
    """DECIDED, AGREED or MOVED for a hinted placement on prefill `best`; `plain_best`: the
    placement without the hint (None when not needed: placed elsewhere)."""
    if prefills[best].id != last.prefill:
        return MOVED
    return AGREED if plain_best == best else DECIDED


def readback_decode(request: RequestView, last: LastTurn) -> str | None:
    """The session's decode where the gateway offers a readback of its last turn from it, else None."""
    sources = request.pull_sources
    if last.decode is None or sources is None or sources.get(last.decode, 0) <= 0:
        return None
    return last.decode


def prefer_decode(
    pred: Predictors, request: RequestView, decode_id: str, decodes: tuple[InstanceView, ...], placed: Placement, slack: float
) -> tuple[Placement, float]:
    """`placed` with its decode moved onto the session's `decode_id` where its TBT now is within
    `slack` of the chosen one's, and the mark: KEPT, AGREED (chosen anyway) or MOVED (gone, loaded)."""
    tbts = placed.decode_tbts
    if tbts is None:
        return placed, MOVED
    if decode_id == placed.decode.instance.id:
        return placed, AGREED
    ids = [d.id for d in decodes]
    j = ids.index(decode_id) if decode_id in ids else None
    if j is None or tbts[j] > tbts[ids.index(placed.decode.instance.id)] * (1.0 + slack):
        return placed, MOVED
    (tbt,), (batch,), (kv,) = decode_loads_now(pred, request, (decodes[j],))
    chosen = DecodeEstimate(decodes[j], tbt, batch, kv, 0.0)
    listed = sorted(
        [*(d for d in placed.decodes_listed if d.instance.id != decode_id), chosen], key=lambda d: ids.index(d.instance.id)
    )
    return replace(placed, decode=chosen, decodes_listed=listed), KEPT


def mark_session(decision: Decision, marks: Marks) -> Decision:
    """The decision with its chosen prefill's candidate marked `session_hint` and its chosen
    decode's `session_affinity`, where there is a mark."""
    prefill, decode = marks
    chosen: dict[tuple[str | None, str], float] = {}
    if prefill is not None and not decision.prefilled_on_decode:
        chosen[decision.prefill, "prefill"] = prefill
    if decode is not None:
        chosen[decision.decode, "decode"] = decode
    if not chosen:
        return decision
    candidates = []
    for c in decision.candidates:
        role = "decode" if c.role is Role.DECODE else "prefill"
        mark = chosen.get((c.instance_id, role))
        candidates.append(c if mark is None else _marked(c, DETAIL if role == "decode" else HINT, mark))
    return replace(decision, candidates=tuple(candidates))


def _marked(c: CandidateScore, key: str, mark: float) -> CandidateScore:
    return replace(c, detail=MappingProxyType({**c.detail, key: mark}))
