"""The emulator's HTTP surface: vLLM's OpenAI server routes plus /emulator/* test hooks.

GET /emulator/requests lists each request's headers and body and, once each leg's first token is
out, `modelled`: per leg (engine sequence) the times the engine modelled for it (queue_s, prefill_s,
ttft_s, transfer_s for a remote-KV decode leg; see engine.py), which CPU contention does not change.
/v1/models, /tokenize, /v1/embeddings and /v1/responses: routes.py. LoRA adapters (static, loaded
at run time, and a request's adapter in its block hashes and KV events): lora.py.

A plain ASGI app: the token path sends pre-encoded SSE bytes straight to the server, and a watcher
on `receive()` sees `http.disconnect` the moment a client goes away, aborts the sequence in the
engine (freeing its batch slot) and records the request id for GET /emulator/cancelled.

A completions batch (`prompt` a list of strings or token-id lists) is served as vLLM serves it: one
engine sequence per prompt (`{id}-{i}`, its own prefix-cache look-up, KV events and usage), their
tokens relayed as they come, choice `index` = prompt position, usage summed, and, for a NIXL
prefill, the first prompt's kv_transfer_params alone on the answer (protocols.py). With `n` > 1 each
prompt is n sequences, choice `index` prompt_idx * n + i (legs.py); `logprobs`: logprobs.py.

Bidirectional NIXL (readback.py): a decode pins its finished requests' KV and names it in a
non-streamed answer; a prefill handed such a handle pulls it before computing the rest, its
`modelled` entry then carrying the pulled tokens (`external_tokens`) and their `transfer_s`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import deque
from typing import Any

import aiohttp

from adapters.emulator.asgi import Receive, Scope, Send, send_bytes, send_json
from adapters.emulator.bootstrap import TransferDone, TransferRegistry, wait_for_prefill
from adapters.emulator.config import EmulatorConfig
from adapters.emulator.effects import TimingEffects
from adapters.emulator.engine import Engine, RemoteWait
from adapters.emulator.kv_content import RemoteKv
from adapters.emulator.kv_events import publisher_for
from adapters.emulator.legs import Leg, batch_usage, fan_out, modelled_times, relay, stream_legs
from adapters.emulator.lora import LoraAdapters, runtime_updates_allowed
from adapters.emulator.metrics import CONTENT_TYPE, EngineMetrics
from adapters.emulator.openai_format import ApiError, error_body, parse_request, priority_of
from adapters.emulator.prefix_cache import PrefixCache
from adapters.emulator.profile import load_profile
from adapters.emulator.protocols import LegPlan, NixlAnswer, plan_leg
from adapters.emulator.readback import KvPuller, ReadbackStore
from adapters.emulator.render import Choice, Renderer
from adapters.emulator.routes import LORA_UPDATE_PATHS, ApiRoutes
from adapters.emulator.tracing import EmulatorTracing
from conductor.core.tokenization import ByteTokenizer
from conductor.core.types import Role
from conductor.core.vllm_hash import VllmBlockHasher, worker_seed

log = logging.getLogger(__name__)


class EmulatorApp(ApiRoutes):
    """One emulated vLLM instance (engine, cache, events, metrics) behind an ASGI callable."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        profile = load_profile(config.profile_path)
        if config.max_num_seqs is not None:
            profile = dataclasses.replace(profile, max_num_seqs=config.max_num_seqs)
        self.profile = profile
        self.tokenizer = ByteTokenizer()
        # a stand-in for a vLLM worker: like vLLM, it reads PYTHONHASHSEED from its own environment
        self.hasher = VllmBlockHasher(config.hash_algo, config.block_size, worker_seed(config.hash_seed, os.environ))
        self.cache = PrefixCache(config.block_size, config.kv_capacity_tokens)
        # like vLLM, runtime loading is allowed by a flag or by VLLM_ALLOW_RUNTIME_LORA_UPDATING
        runtime = config.allow_runtime_lora_updating or runtime_updates_allowed(os.environ)
        self.loras = LoraAdapters(config.model, config.lora_modules, runtime_updates=runtime)
        self.metrics = EngineMetrics(config.model)
        self.publisher = publisher_for(config)
        self.engine = Engine(
            profile,
            self.hasher,
            self.cache,
            self.metrics,
            self.publisher,
            time_scale=config.time_scale,
            noise=config.noise,
            seed=config.seed,
            scheduling_policy=config.scheduling_policy,
            effects=TimingEffects(
                config.max_num_batched_tokens,
                config.mixed_batch_overhead,
                config.kv_pressure_threshold,
                config.kv_pressure_slowdown,
            ),
        )
        self.registry = TransferRegistry()
        self.nixl = NixlAnswer(config.engine_id, config.advertised_host, config.side_channel_port, config.block_size)
        self.readback = ReadbackStore(self.engine, self.nixl, config.pin_ttl_s) if config.serves_readback else None
        self.puller = (
            KvPuller(self._client, config.block_size, config.kv_recompute_threshold, self.metrics.kv_load_failures.inc)
            if config.pulls_readback
            else None
        )
        # who tells a prefill its pinned KV was read: the puller, or on a decode one of its own
        self.notifier = self.puller or (
            KvPuller(self._client, config.block_size, 0, self.metrics.kv_load_failures.inc) if self.readback is not None else None
        )
        self.requests: deque[dict[str, Any]] = deque(maxlen=config.request_log_size)
        self.cancelled: deque[str] = deque(maxlen=config.cancelled_log_size)
        self.created = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self.tracing = (
            EmulatorTracing(config.otlp_traces_endpoint, f"vllm-emulator-{config.role.value}")
            if config.otlp_traces_endpoint
            else None
        )

    # -- lifespan ------------------------------------------------------------------------------
    async def startup(self) -> None:
        self.engine.start()
        if self.publisher is not None:
            self.publisher.start()
        self._session = aiohttp.ClientSession()

    def _client(self) -> aiohttp.ClientSession:
        assert self._session is not None, "startup() not run"
        return self._session

    async def shutdown(self) -> None:
        await self.engine.stop()
        if self.publisher is not None:
            await self.publisher.close()
        if self._session is not None:
            await self._session.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # flush the batched spans

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            try:
                await self._route(scope, receive, send)
            except Exception:  # never a traceback to the client: a vLLM-shaped 500 instead
                log.exception("unhandled error on %s", scope.get("path"))
                with contextlib.suppress(Exception):
                    await send_bytes(send, 500, error_body(ApiError(500, "Internal server error", "InternalServerError")))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- routing -------------------------------------------------------------------------------
    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if method == "POST" and path == "/v1/completions":
            await self._generate(scope, receive, send, chat=False)
        elif method == "POST" and path == "/v1/chat/completions":
            await self._generate(scope, receive, send, chat=True)
        elif method == "POST" and path == "/v1/embeddings":
            await self._embeddings(scope, receive, send)
        elif method == "POST" and path == "/v1/responses":
            await self._responses(scope, receive, send)
        elif method == "GET" and path == "/health":
            await send_bytes(send, 200, b"")
        elif method == "GET" and path == "/metrics":
            await send_bytes(send, 200, self.metrics.render(), CONTENT_TYPE.encode())
        elif method == "GET" and path == "/v1/models":
            await send_json(send, 200, self._models())
        elif method == "POST" and path == "/tokenize":
            await self._tokenize(receive, send)
        elif method == "POST" and path in LORA_UPDATE_PATHS and self.loras.runtime_updates:
            await self._lora_update(path, receive, send)
        elif method == "GET" and path == "/emulator/requests":
            await send_json(send, 200, list(self.requests))
        elif method == "GET" and path == "/emulator/cancelled":
            await send_json(send, 200, {"request_ids": list(self.cancelled)})
        elif method == "GET" and path == "/emulator/state":
            await send_json(send, 200, self._state())
        elif method == "POST" and path in ("/emulator/reset", "/reset_prefix_cache"):
            if path == "/emulator/reset":
                self.requests.clear()
                self.cancelled.clear()
            self.engine.reset_cache()
            await send_json(send, 200, {"status": "ok"})
        else:
            await send_json(send, 404, {"detail": "Not Found"})

    def _state(self) -> dict[str, Any]:
        return {
            "role": self.config.role.value,
            "engine_id": self.config.engine_id,
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            "waiting_for_remote_kv": self.engine.waiting_for_remote,
            "cached_blocks": len(self.cache),
            "kv_usage": self.cache.usage(),
            "steps": self.engine.steps,
            "pinned_for_readback": self.engine.pinned,
        }

    # -- generation ----------------------------------------------------------------------------
    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        accepted = await self._accept(scope, receive, send)
        if accepted is None:
            return
        body = accepted.body
        try:
            req = parse_request(
                chat,
                body,
                tokenizer=self.tokenizer,
                served_model=self.config.model,
                max_model_len=self.config.max_model_len,
                default_max_tokens=self.config.default_max_tokens,
                adapters=self.loras,
            )
            priority = priority_of(body, self.engine.by_priority)
        except ApiError as err:
            await send_bytes(send, err.status, error_body(err), headers=accepted.extra)
            return
        plan = plan_leg(self.config.role, self.config.pd_protocol, body)
        response_id = ("chatcmpl-" if chat else "cmpl-") + accepted.base_id
        # vLLM's serving_completion: one engine request per prompt, and per choice when n > 1
        legs = accepted.track(fan_out(len(req.prompts), req.n, response_id, plan))
        pull = self.puller.pull(plan.readback) if self.puller is not None and plan.readback is not None else None
        for leg in legs:
            leg.seq = self.engine.submit(
                leg.request_id,
                req.prompts[leg.prompt],
                1 if plan.force_one_token else req.max_tokens[leg.prompt],
                self._remote_wait(plan),
                pull=pull,
                pin_on_finish=self._pins(plan),
                priority=priority,
                sample=leg.sample,
                lora=self.loras.get(req.model),
            )
        renderer = Renderer(chat, response_id, int(time.time()), req.model, len(legs), req.logprobs)
        if req.stream:
            work = stream_legs(send, legs, req, renderer, accepted.extra, self._first_token)
        else:
            work = self._complete(send, legs, renderer, plan, accepted.extra)
        await self._running(receive, legs, accepted, req.model, work)

    def _pins(self, plan: LegPlan) -> bool:
        """Whether a leg's KV stays pinned after it finishes, for a reader on the side channel: every
        leg of a bidirectional decode, the NIXL prefill legs of a bidirectional prefill."""
        if self.readback is None:
            return False
        return self.config.role is Role.DECODE or plan.nixl_prefill

    def _remote_wait(self, plan: LegPlan) -> RemoteWait | None:
        if plan.remote_ready:
            ready = RemoteKv(plan.remote_seed, plan.remote_block_ids)
            # a bidirectional decode frees the prefill's pin once it has the KV, as NIXL's notification does
            release = plan.source if self.readback is not None else None

            async def nixl_ready() -> RemoteKv:
                if release is not None and self.notifier is not None:
                    self.notifier.release(release)
                return ready

            return nixl_ready
        url = plan.wait_url
        if url is None:
            return None
        session = self._session
        assert session is not None, "startup() not run"
        deadline = self.config.remote_wait_s
        return lambda: wait_for_prefill(session, url, deadline)

    async def _watch(self, receive: Receive, legs: list[Leg], base_id: str) -> None:
        """Abort every sequence of the request when the client disconnects before they finished."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        live = [leg for leg in legs if not leg.sequence.finished and not leg.sequence.aborted]
        for leg in live:
            self.engine.abort(leg.sequence)
            self._publish(leg, aborted=True)
        if live:
            self.cancelled.append(base_id)

    def _first_token(self, leg: Leg) -> None:
        """The prompt is computed: publish the transfer key, record the modelled times."""
        self._publish(leg)
        if leg.modelled is not None:
            leg.modelled[leg.index] = modelled_times(leg.sequence)

    def _publish(self, leg: Leg, *, aborted: bool = False) -> None:
        key = leg.plan.publish_key
        if key is not None:
            seq = leg.sequence
            self.registry.publish(
                TransferDone(
                    key,
                    "aborted" if aborted else "done",
                    seq.prompt_tokens,
                    seq.cached_tokens,
                    self.config.engine_id,
                    seq.kv_seed,
                )
            )

    async def _complete(
        self, send: Send, legs: list[Leg], renderer: Renderer, plan: LegPlan, extra: list[tuple[bytes, bytes]]
    ) -> None:
        async with contextlib.aclosing(relay(legs, self._first_token)) as tokens:
            async for _ in tokens:
                pass
        seqs = [leg.sequence for leg in legs]
        if any(seq.aborted for seq in seqs):
            return
        # vLLM puts final_res_batch[0].kv_transfer_params on the response: the first prompt's only.
        first = seqs[0]
        kv_params: dict[str, Any] | None = None
        if plan.nixl_prefill:
            cached = first.cached_tokens + first.external_tokens if self.puller is not None else None
            kv_params = self.nixl.params(first.request_id, first.prompt, first.kv_taint, cached)
        elif self.readback is not None:
            kv_params = self.readback.params(first)
        choices = [Choice(seq.text_seed, seq.generated) for seq in seqs]
        await send_bytes(send, 200, renderer.full(choices, batch_usage(legs), kv_params), headers=extra)
