"""The workers the gateway routes to: their health, the load this gateway put on them, and the
cluster snapshot a policy decides from.

Membership changes at run time (conductor/fleet/membership.py drives them: DNS discovery, the admin API):
`add` puts an instance in rotation; `drain` takes it out of rotation while what it serves
finishes, then removes it; `remove` takes it out at once. A removed instance's requests still in
flight are not cut: its bookkeeping moves aside ("retired") until they end, and only then are its
connections closed. Listeners hear of each change (the KV index, the metrics).

Each member's `/v1/models` is read when it first answers its health probe and again every
health.models_refresh_s (adapters loaded at run time); which member serves which model is worked out
again on each change (conductor/fleet/model_pools.py), never per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from adapters.load_share import LoadShare, NoLoadShare, local_table
from adapters.pd.base import Target, decode_json, host_of
from adapters.upstream import Upstream, UpstreamPool
from conductor.config.settings import InstanceSpec, Settings
from conductor.core.errors import ConductorError, NotFound, UpstreamError
from conductor.core.types import ActiveDecode, ClusterSnapshot, QueuedPrefill, Role
from conductor.fleet.health import HealthRules, InstanceHealth, log_panic_change, may_eject, panicking, refused_probe
from conductor.fleet.model_cards import model_list
from conductor.fleet.model_pools import ModelPools, build_pools, take_listing
from conductor.fleet.state import InstanceState, Origin, RemoteEntry

__all__ = ["InstanceExists", "InstanceRegistry", "InstanceState", "MembershipListener", "Origin", "RemoteEntry"]

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often a drain looks whether the instance's last request ended


class InstanceExists(ConductorError):
    """An instance with that name or URL is already a member."""

    status = 409
    type = "invalid_request_error"
    code = "instance_exists"


class MembershipListener(Protocol):
    async def instance_added(self, spec: InstanceSpec) -> None: ...

    async def instance_removed(self, name: str) -> None:
        """Out of rotation for good: forget what routing knows of it (its requests may still run)."""
        ...

    def instance_released(self, name: str) -> None:
        """Its last request ended after its removal (or the wait for that gave up)."""
        ...


class InstanceRegistry:
    """Every configured instance, probed in the background; load accounted per request."""

    def __init__(self, settings: Settings, pool: UpstreamPool, load_share: LoadShare | None = None) -> None:
        self._settings = settings
        self.pool = pool
        self.load_share = load_share or NoLoadShare()
        self.states: dict[str, InstanceState] = {}
        for spec in settings.instances():
            assert spec.name is not None
            upstream = pool.add(spec.name, spec.url)
            target = Target(spec.name, upstream, host_of(spec.url), spec.bootstrap_port, spec.scheduling_policy == "priority")
            self.states[spec.name] = InstanceState(spec=spec, target=target, health=InstanceHealth(spec.name))
        self.listeners: list[MembershipListener] = []
        # removed while requests still ran there: name -> (its state, when to stop waiting for them)
        self.retired: dict[str, tuple[InstanceState, float]] = {}
        self._own_upstreams: dict[str, Upstream] = {}  # those added at run time: closed here
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self.rules = HealthRules(
            unhealthy_after=settings.health.unhealthy_after,
            consecutive_errors=settings.outlier.consecutive_errors,
            ejection_s=settings.outlier.ejection_s,
            max_ejection_s=settings.outlier.max_ejection_s,
            max_ejected_fraction=settings.outlier.max_ejected_fraction,
            panic_threshold=settings.health.panic_threshold,
        )
        self._panic: frozenset[Role] = frozenset()  # the roles routed in panic at the last snapshot
        # who serves which model, the names known, the context lengths: worked out again only on a change
        self.pools: ModelPools = ModelPools()
        self.models_changed()

    # ---- health -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.probe_all()
        self._probe_task = asyncio.create_task(self._probe_forever())
        await self.load_share.start(lambda: local_table(self.states))

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        for task in (*self._drains.values(), *([self._reaper] if self._reaper else [])):
            task.cancel()
        await asyncio.gather(*self._drains.values(), *([self._reaper] if self._reaper else []), return_exceptions=True)
        await self.load_share.close()
        for upstream in self._own_upstreams.values():
            await upstream.close()
        self._own_upstreams.clear()

    # ---- membership ---------------------------------------------------------------------
    async def add(self, spec: InstanceSpec, origin: Origin = "admin") -> InstanceState:
        """Into rotation once its first health probe answers (probed here, right away)."""
        assert spec.name is not None
        url = spec.url.rstrip("/")
        if spec.name in self.states or spec.name in self.retired:
            raise InstanceExists(f"an instance named {spec.name!r} exists already", param="name")
        if any(s.spec.url.rstrip("/") == url for s in self.states.values()):
            raise InstanceExists(f"an instance at {spec.url} exists already", param="url")
        upstream = Upstream(
            spec.name, spec.url, timeouts=self.pool.timeouts, max_connections=self._settings.limits.max_connections_per_upstream
        )
        await upstream.start()
        self._own_upstreams[spec.name] = upstream
        target = Target(spec.name, upstream, host_of(spec.url), spec.bootstrap_port, spec.scheduling_policy == "priority")
        state = InstanceState(spec=spec, target=target, health=InstanceHealth(spec.name), origin=origin)
        self.states[spec.name] = state
        self.models_changed()
        log.info("instance %s (%s, %s) added by %s", spec.name, spec.role.value, spec.url, origin)
        for listener in self.listeners:
            await listener.instance_added(spec)
        await self._probe(state)
        return state

    def drain(self, name: str, by: Origin = "admin") -> InstanceState:
        """Out of rotation now; removed when its last request here ends, or after timeouts.drain_grace_s."""
        state = self._member(name)
        if not state.draining:
            state.draining, state.drained_by = True, by
            log.info("instance %s draining (%s; %d requests in flight)", name, by, state.inflight)
            self._drains[name] = asyncio.create_task(self._finish_drain(name), name=f"drain-{name}")
        return state

    def undrain(self, name: str) -> None:
        """Back into rotation (DNS lists again an address it had stopped listing)."""
        state = self._member(name)
        task = self._drains.pop(name, None)
        if task is not None:
            task.cancel()
        state.draining, state.drained_by = False, None
        log.info("instance %s back in rotation", name)

    async def remove(self, name: str) -> None:
        """Out at once. Its requests in flight run on; its connections close when they end."""
        state = self._member(name)
        del self.states[name]
        self.models_changed()
        task = self._drains.pop(name, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        # past timeouts.request_s no request of it can still run: the deadline sweep closed it
        self.retired[name] = (state, time.monotonic() + self._settings.timeouts.request_s + 1.0)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap(), name="retired-instances")
        log.info("instance %s removed (%d requests still in flight)", name, state.inflight)
        for listener in self.listeners:
            await listener.instance_removed(name)

    def _member(self, name: str) -> InstanceState:
        state = self.states.get(name)
        if state is None:
            raise NotFound(f"no instance named {name!r}", param="name", code="instance_not_found")
        return state

    async def _finish_drain(self, name: str) -> None:
        deadline = time.monotonic() + self._settings.timeouts.drain_grace_s
        while (state := self.states.get(name)) is not None and state.draining:
            if state.inflight == 0 or time.monotonic() >= deadline:
                self._drains.pop(name, None)
                await self.remove(name)
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def _reap(self) -> None:
        while self.retired:
            await asyncio.sleep(DRAIN_POLL_S)
            now = time.monotonic()
            for name, (state, give_up_at) in list(self.retired.items()):
                if state.inflight == 0 or now >= give_up_at:
                    del self.retired[name]
                    upstream = self._own_upstreams.pop(name, None)
                    if upstream is not None:
                        await upstream.close()
                    for listener in self.listeners:
                        listener.instance_released(name)

    async def _probe_forever(self) -> None:
        """Every instance each health.interval_s; between those rounds, the instances out of
        rotation each health.unhealthy_interval_s (when that is the shorter)."""
        full_s = self._settings.health.interval_s
        tick_s = min(full_s, self._settings.health.unhealthy_interval_s)
        next_full = time.monotonic() + full_s
        while True:
            await asyncio.sleep(max(0.0, min(tick_s, next_full - time.monotonic())))
            try:
                if time.monotonic() >= next_full:
                    next_full = time.monotonic() + full_s
                    await self.probe_all()
                else:
                    await self.probe_unavailable()
            except Exception:  # a probe bug must never kill health checking
                log.exception("health probe round failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in self.states.values()))

    async def probe_unavailable(self) -> None:
        """Probe only the instances that cannot take requests now (an ejected one comes back on
        the first good probe once its ejection is over)."""
        await asyncio.gather(*(self._probe(s) for s in self.states.values() if not s.health.available))

    async def _probe(self, state: InstanceState) -> None:
        timeout = self._settings.health.timeout_s
        refused = None
        try:
            # probes use the instance's own small probe pool: a decode whose every pooled
            # connection carries a stream is busy, not dead
            reply = await state.target.upstream.get("/health", timeout_s=timeout, probe=True)
            ok = reply.status == 200
        except (UpstreamError, ValueError, AttributeError) as exc:
            ok, refused = False, refused_probe(exc)
        if ok and time.monotonic() >= state.models_due:
            # before the probe counts: an instance back in rotation is routed by what it serves now
            await self._read_models(state, timeout)
        self.record_probe(state, ok, refused)

    async def _read_models(self, state: InstanceState, timeout_s: float) -> None:
        """The member's `/v1/models` taken in. A failed read keeps the lists it had and is tried
        again at the next probe; it fails no probe (its /health answered)."""
        try:
            reply = await state.target.upstream.get("/v1/models", timeout_s=timeout_s, probe=True)
            data = decode_json(reply.body).get("data") if reply.status == 200 else None
        except (UpstreamError, ValueError, AttributeError) as exc:
            log.debug("instance %s: /v1/models not read (%s)", state.name, exc)
            return
        if data is None:
            return
        state.models_due = time.monotonic() + self._settings.health.models_refresh_s
        if take_listing(state, data) and self.states.get(state.name) is state:
            self.models_changed()

    def record_probe(self, state: InstanceState, ok: bool, refused: bool | None = None) -> None:
        state.health.on_probe(ok, time.monotonic(), self.rules, refused)

    def report_failure(self, name: str) -> None:
        """A request to the instance could not even connect: count it like a failed probe too."""
        state = self.states.get(name)
        if state is not None:
            self.record_probe(state, False)

    def report_result(self, name: str, ok: bool) -> bool:
        """A request's leg on this instance succeeded or failed (5xx, reset, refused): passive
        outlier detection. True when the failure ejected the instance."""
        state = self.states.get(name)
        if state is None:
            return False
        if ok:
            state.health.on_success()
            return False
        peers = [s.health for s in self.states.values() if s.spec.role == state.spec.role]
        return state.health.on_error(time.monotonic(), self.rules, may_eject(peers, self.rules))

    def healthy_count(self, role: Role) -> int:
        return sum(1 for s in self.states.values() if s.spec.role == role and s.healthy)

    def context_length(self, model: str | None) -> int | None:
        """The smallest context length the members serving `model` report (a request may land on
        any of them); when none names the model, the smallest any member reports; None when no
        member reports one. What bounds a prompt's tokens (conductor/kv/prompt_bounds.py)."""
        pools = self.pools
        return pools.contexts.get(model, pools.smallest_context) if model is not None else pools.smallest_context

    def models_changed(self) -> None:
        """A member's lists changed, or a member came or went: the pools worked out again."""
        settings = self._settings
        loadable = {name: spec.base for name, spec in settings.lora_adapters.items()}
        self.pools = build_pools(self.states.values(), settings.models, settings.model_aliases, loadable)

    def models(self) -> tuple[str, ...]:
        """Every model name known: the configured ones, the members' base models, their adapters
        (what a request may name: `pools.known`; the members outside a model's pool: `pools.excluded`)."""
        return self.pools.names

    def model_list(self) -> dict[str, object]:
        """The gateway's `/v1/models` body: every model, adapter and alias (conductor/fleet/model_cards.py)."""
        return model_list(self.pools.names, self.states.values(), aliases=self.pools.aliases)

    # ---- load accounting -----------------------------------------------------------------
    def snapshot(self, exclude: frozenset[str] = frozenset(), outside: frozenset[str] = frozenset()) -> ClusterSnapshot:
        """The cluster as policies see it; `exclude`: instances this request already failed on
        (shown unhealthy, so a failover decides among the others); `outside`: the instances that do
        not serve the request's model (conductor/fleet/model_pools.py), left out of the snapshot."""
        now = time.monotonic()
        remote = self.load_share.remote()
        ends = self.load_share.prefill_ends() if remote else {}
        # a draining instance is no candidate at all (not even a "down" one a policy might count)
        members = [s for s in self.states.values() if not s.draining]
        panic = self.panic_roles(members)
        if outside:
            # another model's instances are no candidates either; their views (each copying its
            # queue and streams) were most of a decision at 256 instances (bench_decision.py --models)
            members = [s for s in members if s.name not in outside]
        if not remote and not exclude and not panic:  # the usual case: each view from its own state alone
            return ClusterSnapshot(now=now, instances=tuple([s.view(now) for s in members]))
        views = [s.view(now, remote.get(s.name), s.name in exclude, ends.get(s.name), s.spec.role in panic) for s in members]
        return ClusterSnapshot(now=now, instances=tuple(views))

    def panic_roles(self, members: list[InstanceState]) -> frozenset[Role]:
        """The roles below the panic threshold among `members` (fleet/health.py, `panicking`);
        a role entering or leaving panic is logged once."""
        if not self._panic:
            for state in members:
                if not state.health.available:
                    break
            else:
                return self._panic  # the usual case, on every snapshot: no role can be below a threshold
        by_role: dict[Role, list[InstanceHealth]] = {}
        for state in members:
            by_role.setdefault(state.spec.role, []).append(state.health)
        panic = frozenset(role for role, healths in by_role.items() if panicking(healths, self.rules))
        if panic != self._panic:
            log_panic_change(self._panic, panic, by_role, self.rules)
            self._panic = panic
        return panic

    def _state(self, name: str) -> InstanceState | None:
        """A member's bookkeeping, or a removed one's while its requests still run."""
        state = self.states.get(name)
        if state is None and name in self.retired:
            state = self.retired[name][0]
        return state

    def add_prefill(self, name: str, request_id: str, new_tokens: int, cached_tokens: int, end_seen: bool = True) -> None:
        """`end_seen`: QueuedPrefill.end_seen (the gateway will see the prefill end, not only the answer)."""
        state = self.states[name]  # only a member is routed to
        state.prefills[request_id] = QueuedPrefill(new_tokens, cached_tokens, 0.0, end_seen)
        state.started[request_id] = time.monotonic()
        self.load_share.changed()

    def end_prefill(self, name: str, request_id: str) -> None:
        state = self._state(name)
        if state is None or request_id not in state.prefills:
            return  # (ended already: a stream's prefill ends at its first token, then again at its end)
        was_head = next(iter(state.prefills)) == request_id
        if state.prefills.pop(request_id, None) is not None:
            del state.started[request_id]
            state.last_prefill_end = time.monotonic()
            self.load_share.changed()
            if was_head and state.prefills:
                # FCFS: the next one starts running now, so its elapsed time (the only one a queue
                # estimate subtracts) counts from here; from its dispatch it would include its wait
                nxt = next(iter(state.prefills))
                state.started[nxt] = max(state.started[nxt], time.monotonic())

    def add_decode(self, name: str, request_id: str, context_tokens: int, max_tokens: int) -> None:
        # listed from dispatch, so forecasts count it; "decoding" once its first token arrives
        self.states[name].decodes[request_id] = ActiveDecode(context_tokens, max_tokens, decoding=False)

    def advance_decode(self, name: str, request_id: str, tokens: int, first_token_at: float | None = None) -> None:
        """`tokens` more of the stream relayed; `first_token_at`: when its first came (time.monotonic),
        where the relay watched its pace (what a mixed worker's streams have saved, stall_fits)."""
        state = self._state(name)
        if state is None:
            return
        decodes = state.decodes
        decode = decodes.get(request_id)
        if decode is not None and tokens:
            decodes[request_id] = ActiveDecode(
                decode.context_tokens + tokens,
                max(0, decode.remaining_tokens - tokens),
                True,
                decode.generated + tokens,
                decode.first_token_at if first_token_at is None else first_token_at,
            )

    def mark_decoding(self, name: str, request_id: str) -> None:
        """The request's prefill is over (its KV is on the decode instance, or about to be)."""
        state = self._state(name)
        if state is None:
            return
        decodes = state.decodes
        decode = decodes.get(request_id)
        if decode is not None and not decode.decoding:
            decodes[request_id] = ActiveDecode(
                decode.context_tokens, decode.remaining_tokens, True, decode.generated, decode.first_token_at
            )

    def end_decode(self, name: str, request_id: str) -> None:
        state = self._state(name)
        if state is not None and state.decodes.pop(request_id, None) is not None:
            self.load_share.changed()
