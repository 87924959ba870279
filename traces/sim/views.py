"""Building the frozen values the simulator hands to policies, at the rate it needs them.

The engine rebuilds every decode instance's `InstanceView` (with its streams' `ActiveDecode`
entries) and every running prefill's (with its head's `QueuedPrefill`) at nearly every arrival:
the refresh interval (0.1 s) is shorter than the trace's time between arrivals, and a decoding
stream's entry moves with every token. A frozen slotted dataclass's generated `__init__` sets each
field through `object.__setattr__` by name and handles defaults, which for InstanceView's nine
fields costs about twice what storing them does. These builders make the same objects (equal to
the dataclass-built ones, field for field: tested in tests/traces/test_sim_views.py) by storing
each slot through its descriptor.

The request view, the snapshot and the observation of each request are built the same way (one
of each per request; RequestView has seventeen fields and Observation fourteen).

They check, once at import, that the classes still have exactly the fields written here, so a
field added to conductor/core/types.py fails loudly instead of being left unset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields

from conductor.core.types import (
    ActiveDecode,
    CachedPrefix,
    ClusterSnapshot,
    InstanceView,
    Observation,
    PrefillLeg,
    QueuedPrefill,
    RequestView,
    Role,
    Slo,
)
from traces.sim.cluster import Job

_VIEW_FIELDS = ("id", "role", "url", "healthy", "prefill_queue", "decodes", "kv_capacity_tokens", "kv_usage", "waiting_requests")
_DECODE_FIELDS = ("context_tokens", "remaining_tokens", "decoding", "generated", "first_token_at")
_QUEUED_FIELDS = ("new_tokens", "cached_tokens", "elapsed_s", "end_seen")
_REQUEST_FIELDS = (
    "request_id",
    "seq",
    "model",
    "prompt_tokens",
    "max_tokens",
    "block_size",
    "block_keys",
    "cached",
    "store_cached_tokens",
    "slo",
    "stream",
    "pull_sources",
    "queued_pull_sources",
    "staging_jumps_queue",
    "priority",
    "tenant",
    "session",
)
_SNAPSHOT_FIELDS = ("now", "instances")
_OBSERVATION_FIELDS = (
    "request_id",
    "prefill",
    "decode",
    "prompt_tokens",
    "cached_tokens",
    "predicted_cached_tokens",
    "queue_and_prefill_s",
    "ttft_s",
    "token_intervals_s",
    "output_tokens",
    "decode_batch",
    "decode_resident_kv_tokens",
    "ok",
    "reported_prompt_tokens",
)


def _setters(cls: type, expected: tuple[str, ...]) -> list[Callable[[object, object], None]]:
    names = tuple(f.name for f in fields(cls))
    if names != expected:
        raise RuntimeError(f"{cls.__name__} has fields {names}, traces/sim/views.py builds {expected}")
    return [cls.__dict__[name].__set__ for name in names]


_new = object.__new__
_v_id, _v_role, _v_url, _v_healthy, _v_queue, _v_decodes, _v_kv_cap, _v_kv_usage, _v_waiting = _setters(
    InstanceView, _VIEW_FIELDS
)
_d_context, _d_remaining, _d_decoding, _d_generated, _d_first = _setters(ActiveDecode, _DECODE_FIELDS)
_q_new, _q_cached, _q_elapsed, _q_end_seen = _setters(QueuedPrefill, _QUEUED_FIELDS)
(
    _r_id,
    _r_seq,
    _r_model,
    _r_prompt,
    _r_max,
    _r_block,
    _r_keys,
    _r_cached,
    _r_store,
    _r_slo,
    _r_stream,
    _r_pull,
    _r_queued,
    _r_jumps,
    _r_priority,
    _r_tenant,
    _r_session,
) = _setters(RequestView, _REQUEST_FIELDS)
_NO_SOURCES: frozenset[str] = frozenset()
_s_now, _s_instances = _setters(ClusterSnapshot, _SNAPSHOT_FIELDS)
(
    _o_id,
    _o_prefill,
    _o_decode,
    _o_prompt,
    _o_cached,
    _o_predicted,
    _o_leg,
    _o_ttft,
    _o_intervals,
    _o_output,
    _o_batch,
    _o_resident,
    _o_ok,
    _o_reported,
) = _setters(Observation, _OBSERVATION_FIELDS)


def instance_view(
    instance_id: str,
    role: Role,
    prefill_queue: tuple[QueuedPrefill, ...] = (),
    decodes: tuple[ActiveDecode, ...] = (),
    kv_capacity_tokens: int | None = None,
    kv_usage: float | None = None,
    waiting_requests: int | None = None,
) -> InstanceView:
    """InstanceView(id=instance_id, role=role, ...) of a healthy instance without a URL."""
    view: InstanceView = _new(InstanceView)
    _v_id(view, instance_id)
    _v_role(view, role)
    _v_url(view, "")
    _v_healthy(view, True)
    _v_queue(view, prefill_queue)
    _v_decodes(view, decodes)
    _v_kv_cap(view, kv_capacity_tokens)
    _v_kv_usage(view, kv_usage)
    _v_waiting(view, waiting_requests)
    return view


def active_decode(
    context_tokens: int, remaining_tokens: int, decoding: bool = True, generated: int = 0, first_token_at: float | None = None
) -> ActiveDecode:
    """ActiveDecode(context_tokens, remaining_tokens, decoding, generated, first_token_at)."""
    entry: ActiveDecode = _new(ActiveDecode)
    _d_context(entry, context_tokens)
    _d_remaining(entry, remaining_tokens)
    _d_decoding(entry, decoding)
    _d_generated(entry, generated)
    _d_first(entry, first_token_at)
    return entry


def queued_prefill(new_tokens: int, cached_tokens: int, elapsed_s: float) -> QueuedPrefill:
    """QueuedPrefill(new_tokens, cached_tokens, elapsed_s): the simulator sees every prefill end."""
    entry: QueuedPrefill = _new(QueuedPrefill)
    _q_new(entry, new_tokens)
    _q_cached(entry, cached_tokens)
    _q_elapsed(entry, elapsed_s)
    _q_end_seen(entry, True)
    return entry


def request_view(
    request_id: str,
    seq: int,
    model: str,
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    block_keys: tuple[int, ...],
    cached: Mapping[str, CachedPrefix],
    store_cached_tokens: int,
    slo: Slo,
    queued_pull_sources: frozenset[str] = _NO_SOURCES,
    staging_jumps_queue: bool = False,
    session: int | None = None,
    priority: str | None = None,
    tenant: str | None = None,
) -> RequestView:
    """RequestView(...) of a streamed request whose every cached instance is a pull source
    (stream=True, pull_sources=None), those in `queued_pull_sources` read after a staging request,
    of the trace's `session` (None: none), of class `priority` sent by `tenant` (None: none)."""
    view: RequestView = _new(RequestView)
    _r_id(view, request_id)
    _r_seq(view, seq)
    _r_model(view, model)
    _r_prompt(view, prompt_tokens)
    _r_max(view, max_tokens)
    _r_block(view, block_size)
    _r_keys(view, block_keys)
    _r_cached(view, cached)
    _r_store(view, store_cached_tokens)
    _r_slo(view, slo)
    _r_stream(view, True)
    _r_pull(view, None)
    _r_queued(view, queued_pull_sources)
    _r_jumps(view, staging_jumps_queue)
    _r_priority(view, priority)
    _r_tenant(view, tenant)
    _r_session(view, session)
    return view


def cluster_snapshot(now: float, instances: tuple[InstanceView, ...]) -> ClusterSnapshot:
    """ClusterSnapshot(now, instances)."""
    snap: ClusterSnapshot = _new(ClusterSnapshot)
    _s_now(snap, now)
    _s_instances(snap, instances)
    return snap


def observation(
    request_id: str,
    prefill: str | None,
    decode: str | None,
    prompt_tokens: int,
    cached_tokens: int | None,
    predicted_cached_tokens: int,
    queue_and_prefill_s: float | None,
    ttft_s: float | None,
    token_intervals_s: tuple[float, ...] = (),
    output_tokens: int = 0,
    decode_batch: int = 0,
    decode_resident_kv_tokens: int = 0,
    ok: bool = True,
) -> Observation:
    """Observation(...) without a reported prompt size (reported_prompt_tokens=None)."""
    obs: Observation = _new(Observation)
    _o_id(obs, request_id)
    _o_prefill(obs, prefill)
    _o_decode(obs, decode)
    _o_prompt(obs, prompt_tokens)
    _o_cached(obs, cached_tokens)
    _o_predicted(obs, predicted_cached_tokens)
    _o_leg(obs, queue_and_prefill_s)
    _o_ttft(obs, ttft_s)
    _o_intervals(obs, token_intervals_s)
    _o_output(obs, output_tokens)
    _o_batch(obs, decode_batch)
    _o_resident(obs, decode_resident_kv_tokens)
    _o_ok(obs, ok)
    _o_reported(obs, None)
    return obs


def job_observation(job: Job, prefill: str, decode: str | None) -> Observation:
    """What a finished job teaches the policy, as the gateway's Observation of a live request; on a
    mixed worker (`decode` None) without a prefill leg, as the gateway has none to time there."""
    out = job.output_tokens
    mean_tbt = (job.finish - job.first_token) / (out - 1) if out > 1 else 0.0
    return observation(
        request_id=f"r{job.seq}",
        decode=decode,
        prefill=prefill,
        prompt_tokens=job.req.input_length,
        cached_tokens=job.reused,
        predicted_cached_tokens=job.predicted_cached,
        queue_and_prefill_s=job.prefill_done - job.dispatch if decode is not None else None,
        ttft_s=job.first_token - job.dispatch,  # from its admission, as the gateway learns it (a held job's wait is not)
        token_intervals_s=(mean_tbt,) * (out - 1),
        output_tokens=out,
        # Observation counts the *other* streams and their KV (batch_at_join includes this one,
        # and resident_at_join its prompt twice: resident_kv() after the join plus the prompt)
        decode_batch=job.batch_at_join - 1,
        decode_resident_kv_tokens=max(0, job.resident_at_join - 2 * job.req.input_length),
    )


def mixed_leg(job: Job, worker: str) -> PrefillLeg:
    """A mixed worker's leg, told at its first token as the gateway tells a stream's: from its
    admission (its Observation's ttft_s), the worker's cached tokens unknown until its last chunk."""
    return PrefillLeg(f"r{job.seq}", worker, job.req.input_length, None, job.first_token - job.dispatch)


def refused_observation(job: Job, prefill: str, decode: str) -> Observation:
    """A job whose prefill ran but whose decode refused it (the simulator's decode guard): a failure."""
    return observation(
        request_id=f"r{job.seq}",
        prefill=prefill,
        decode=decode,
        prompt_tokens=job.req.input_length,
        cached_tokens=job.reused,
        predicted_cached_tokens=job.predicted_cached,
        queue_and_prefill_s=None,
        ttft_s=None,
        ok=False,
    )
