"""LoRA adapters the gateway loads on a worker at run time, and which adapter a model names.

`lora_adapters` (settings) names the adapters the gateway may load: name -> path and base model.
A request for one of them reaches the relay with the instances the policy chose; each of those
that does not list the adapter gets `POST /v1/load_lora_adapter {lora_name, lora_path}` before
the request is forwarded (vLLM serves that route with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1):

- once per instance and adapter: concurrent requests wait for the same load (shielded: a client
  that leaves does not cancel it for the others);
- a success is recorded in the instance's adapters at once (as its /v1/models will list it: the
  KV keys and the model pools see it without waiting for the next read), logged once at INFO, and
  counted in conductor_lora_loads_total{instance,result} ("loaded"; "present" when the worker
  already held it; "failed");
- a failure is an UpstreamError naming the instance (a 502, or another instance when a failover is
  left); nothing is recorded, so the next request tries again.

A cap per instance (`max_per_instance`) bounds the adapters the gateway itself loaded there. Past
it the least recently used of them that no request is using is unloaded first (`POST
/v1/unload_lora_adapter`, conductor_lora_unloads_total); when every one is in use the request
fails like a failed load. A request holds the adapters it uses from before their load until its
attempt ends (`release`), so an unload never pulls one from under it.

`adapter_for` and `instance_adapter` say which adapter (name, base, path) a model names, for the
prompt's KV keys and the KV events' (conductor/core/adapter_keys.py): the one an instance lists,
else the one the settings name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import NoReturn

from prometheus_client import CollectorRegistry, Counter

from conductor.config.settings import LoraAdapterSpec
from conductor.core.errors import UpstreamError
from conductor.core.models import AdapterCard
from conductor.fleet.instances import InstanceRegistry, InstanceState

__all__ = ["MAX_LOADED_PER_INSTANCE", "AdapterLoads"]

log = logging.getLogger(__name__)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
# adapters the gateway loads on one instance at most (vLLM keeps every loaded adapter listed and
# its weights on the host: --max-cpu-loras bounds only its cache of them)
MAX_LOADED_PER_INSTANCE = 8
_ALREADY_LOADED = b"has already been loaded"  # vLLM's 400 for a second load of a name


class AdapterLoads:
    """Runtime loads of the `lora_adapters` the settings name, on the instances requests go to."""

    def __init__(
        self,
        specs: Mapping[str, LoraAdapterSpec],
        registry: InstanceRegistry,
        metrics: CollectorRegistry | None = None,
        *,
        upstream_key: str | None = None,
        max_per_instance: int = MAX_LOADED_PER_INSTANCE,
        timeout_s: float = 120.0,
    ) -> None:
        self.specs = dict(specs)
        self.registry = registry
        self.max_per_instance = max_per_instance
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json"}
        if upstream_key:
            self.headers["Authorization"] = f"Bearer {upstream_key}"
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._loaded: dict[str, OrderedDict[str, None]] = {}  # instance -> what the gateway loaded, LRU first
        self._users: dict[tuple[str, str], int] = {}  # (instance, adapter) -> requests holding it
        self._held: dict[str, list[tuple[str, str]]] = {}  # request id -> what it holds
        r = metrics or CollectorRegistry()
        self.loads = Counter("conductor_lora_loads", "LoRA adapters loaded by the gateway", ["instance", "result"], registry=r)
        self.unloads = Counter(
            "conductor_lora_unloads", "LoRA adapters the gateway unloaded for others", ["instance", "result"], registry=r
        )

    # ---- which adapter a model names -------------------------------------------------------------
    def adapter_for(self, model: str) -> AdapterCard | None:
        """The adapter `model` names: one an instance lists (the first found), else the settings'
        (None: a base model). Per request: the listed adapters are gathered with the model pools,
        once per change of a listing (conductor/fleet/model_pools.py)."""
        found = self.registry.pools.adapters.get(model)
        if found is not None:
            return found
        spec = self.specs.get(model)
        return None if spec is None else AdapterCard(model, spec.base or "", spec.path)

    def instance_adapter(self, instance: str, name: str) -> AdapterCard | None:
        """The adapter `instance` lists under `name` (its KV events name it, never its path)."""
        state = self.registry.states.get(instance)
        card = state.adapters.get(name) if state is not None else None
        return card if card is not None else self.adapter_for(name)

    # ---- the request path ------------------------------------------------------------------------
    async def ensure(self, request_id: str, model: str, instances: Sequence[str]) -> None:
        """`model`, when it is an adapter the gateway may load, loaded on each of `instances` that
        does not list it; held for `request_id` until `release`. UpstreamError when a load fails."""
        spec = self.specs.get(model)
        if spec is None:
            return
        for name in dict.fromkeys(instances):
            state = self.registry.states.get(name)
            if state is None:
                continue
            self._hold(request_id, (name, model))
            if model in state.adapters:
                loaded = self._loaded.get(name)
                if loaded is not None and model in loaded:
                    loaded.move_to_end(model)  # in use: the last to be unloaded
                continue
            await self._load_once(state, model, spec)

    def release(self, request_id: str) -> None:
        """The request's attempt ended: the adapters it held may be unloaded again."""
        for key in self._held.pop(request_id, ()):
            left = self._users.get(key, 0) - 1
            if left > 0:
                self._users[key] = left
            else:
                self._users.pop(key, None)

    def _hold(self, request_id: str, key: tuple[str, str]) -> None:
        self._held.setdefault(request_id, []).append(key)
        self._users[key] = self._users.get(key, 0) + 1

    async def _load_once(self, state: InstanceState, model: str, spec: LoraAdapterSpec) -> None:
        key = (state.name, model)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(state, model, spec), name=f"lora-load-{model}")
            self._loading[key] = task
            task.add_done_callback(lambda done: self._loaded_or_failed(key, done))
        await asyncio.shield(task)

    def _loaded_or_failed(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]
        if not task.cancelled():
            task.exception()  # retrieved: the waiters (if any are left) raise it themselves

    async def _load(self, state: InstanceState, model: str, spec: LoraAdapterSpec) -> None:
        name = state.name
        loaded = self._loaded.setdefault(name, OrderedDict())
        for gone in [m for m in loaded if m not in state.adapters and (name, m) not in self._loading]:
            del loaded[gone]  # unloaded by someone else since: no longer counted against the cap
        others = sum(1 for i, m in self._loading if i == name and m != model)  # loading beside this one
        if len(loaded) + others >= self.max_per_instance:
            await self._make_room(state, loaded)
        started = time.monotonic()
        body = json.dumps({"lora_name": model, "lora_path": spec.path}).encode()
        try:
            reply = await state.target.upstream.post(LOAD_PATH, body, self.headers, total_s=self.timeout_s)
        except UpstreamError as exc:
            self._failed(name, model, exc.message)
        present = reply.status == 400 and _ALREADY_LOADED in reply.body
        if reply.status != 200 and not present:
            self._failed(name, model, f"HTTP {reply.status}: {reply.body[:200].decode(errors='replace')}")
        self.loads.labels(name, "present" if present else "loaded").inc()
        if not present:  # one the worker held already (another replica's, an operator's) is not ours to unload
            loaded[model] = None
        base = spec.base or (state.models[0] if state.models else "")
        self._record(state, {**state.adapters, model: AdapterCard(model, base, spec.path)})
        log.info(
            "LoRA adapter %s (%s) %s on %s in %.2f s",
            model,
            spec.path,
            "already loaded" if present else "loaded",
            name,
            time.monotonic() - started,
        )

    def _failed(self, instance: str, model: str, why: str) -> NoReturn:
        self.loads.labels(instance, "failed").inc()
        log.warning("loading LoRA adapter %s on %s failed: %s", model, instance, why)
        # no byte of the request itself reached the worker: another instance may be tried
        raise UpstreamError(f"loading LoRA adapter {model} on {instance} failed: {why}", instance=instance, maybe_processed=False)

    async def _make_room(self, state: InstanceState, loaded: OrderedDict[str, None]) -> None:
        """Unload the least recently used adapter the gateway loaded on `state` that no request
        holds; UpstreamError when each one is held or loading."""
        name = state.name
        idle = next((m for m in loaded if not self._users.get((name, m)) and (name, m) not in self._loading), None)
        if idle is None:
            raise UpstreamError(
                f"{name} holds {len(loaded)} LoRA adapters loaded by the gateway, its cap, each in use",
                instance=name,
                maybe_processed=False,
            )
        del loaded[idle]
        body = json.dumps({"lora_name": idle}).encode()
        try:
            reply = await state.target.upstream.post(UNLOAD_PATH, body, self.headers, total_s=self.timeout_s)
            result = "unloaded" if reply.status in (200, 404) else "failed"  # 404: gone already
        except UpstreamError:
            result = "failed"
        self.unloads.labels(name, result).inc()
        log.info("LoRA adapter %s unloaded from %s to make room (%s)", idle, name, result)
        self._record(state, {m: card for m, card in state.adapters.items() if m != idle})

    def _record(self, state: InstanceState, adapters: dict[str, AdapterCard]) -> None:
        """The instance's adapters as they are now: its model pool and the lookups follow at once."""
        state.adapters = adapters
        self.registry.models_changed()  # the registry's own rebuild after any change of a listing
