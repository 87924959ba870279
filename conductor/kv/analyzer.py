"""The real PromptAnalyzer: tokenize, key the blocks, ask the index where they live.

Wiring, per request: the prompt's length bound (`conductor.kv.prompt_bounds`: its size, then its token count) ->
tokenizer -> block keys (`conductor.core.block_keys`; both off the event loop for a long prompt,
`conductor.kv.encoding`) -> `KVIndex.match` (and a Mooncake Store probe) -> PromptAnalysis. The KV event feeds:
`conductor.kv.feeds`. After the decision the prompt's keys are inserted for the chosen prefill instance as unconfirmed
entries; vLLM's KV events confirm (or remove) them. When a request finishes, the cached tokens the worker reports are
compared with what the index predicted, both ways and per instance (`conductor.kv.agreement.HashAgreement`): predicted
hits the workers never see (the gateway's keys are not the workers') and hits the workers see that the index did not
predict (events missing, wrong seed, a gateway started late) each raise a loud warning that names the likely cause.
Per-instance KV event metrics: `conductor.kv.event_metrics`.

Build it with `build_analyzer(options, instances, registry)`; options: `KVAwarenessSettings` (conductor.config.kv).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq.asyncio
from prometheus_client import CollectorRegistry

from adapters.auto_tokenizer import AutoTokenizer
from adapters.index.base import KVIndex, PrefixMatch
from adapters.index.feed import IndexFeeder, mapped_within
from adapters.index.guarded import GuardedIndex
from adapters.index.memory import MemoryIndex
from adapters.index.metrics import register_kv_memory
from adapters.kv_events import EventSubscriber
from adapters.mooncake_store import MooncakeStoreProbe, StoreProbe
from adapters.tokenizers import PromptTokenizer
from conductor.config.kv import KVAwarenessSettings, KVEventsEndpoint, warn_about_setup
from conductor.core.block_keys import BlockKeyScheme, make_scheme
from conductor.core.errors import BadRequest, ConductorError, ConfigError
from conductor.core.event_bounds import DEFAULT_EVENT_BOUNDS, EventBounds
from conductor.core.models import AdapterCard
from conductor.core.prefix_memo import PrefixMemo
from conductor.core.types import CachedPrefix, Decision, Observation, Role
from conductor.kv.agreement import FeedEvidence, HashAgreement, build_agreement
from conductor.kv.analysis import PromptAnalysis, PromptAnalyzer, RequestKind, SizedVocabulary, estimate_prompt_tokens
from conductor.kv.canary import KVCanary, build_canary
from conductor.kv.encoding import PromptEncoder, chars_per_token, make_tokenizer
from conductor.kv.event_metrics import KVEventsCollector
from conductor.kv.feeds import (
    feed_progress,
    first_address,
    start_subscribers,
    subscribers_for,
    watch_silent_instances,
)
from conductor.kv.index_factory import index_memory, make_index, prefix_memo
from conductor.kv.prompt_bounds import PromptBound, check_prompt_size, check_token_count

__all__ = ["HashAgreement", "KVAwareAnalyzer", "KVAwarenessSettings", "KVEventsEndpoint", "build_analyzer"]

log = logging.getLogger(__name__)

InstanceInfo = tuple[str, Role, str]  # (id, role, base URL)


class KVAwareAnalyzer:
    """PromptAnalyzer backed by a tokenizer, a block key scheme, an index and its feeds."""

    MAX_PENDING_DISPATCHES = 256  # background index inserts in flight before dispatches wait

    def __init__(
        self,
        *,
        tokenizer: PromptTokenizer,
        scheme: BlockKeyScheme,
        index: KVIndex,
        feeder: IndexFeeder,
        agreement: HashAgreement,
        subscribers: Sequence[EventSubscriber] = (),
        store: StoreProbe | None = None,
        instances: Sequence[InstanceInfo] = (),
        forward_token_ids: bool = True,
        events_silence_s: float = 30.0,
        zmq_context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 1.0,
        replay_on_start: bool = True,
        event_bounds: EventBounds = DEFAULT_EVENT_BOUNDS,
        prefix_memo: PrefixMemo | None = None,
        keep_token_ids: bool = False,
        prompt_bound: PromptBound | None = None,
        max_chars_per_token: int | None = None,
        adapter_for: Callable[[str], AdapterCard | None] | None = None,
        canary: KVCanary | None = None,
    ) -> None:
        """adapter_for: the LoRA adapter a request's `model` names (None: a base model), whose
        blocks are keyed with it as vLLM hashes them (conductor/core/adapter_keys.py). canary: checks
        each instance's events before its cache counts (conductor/kv/canary.py; it sits between the
        subscribers and `feeder`)."""
        self.tokenizer = tokenizer
        # checked once; its size is read per request (kv.tokenizer auto chooses on first use)
        self._vocabulary = tokenizer if isinstance(tokenizer, SizedVocabulary) else None
        self.adapter_for = adapter_for
        self.scheme = scheme
        self.prefix_memo = prefix_memo  # the scheme's keys, each shared prefix hashed once
        self.encoder = PromptEncoder(tokenizer, scheme, prefix_memo)  # long prompts off the event loop
        # how long a prompt may be (the gateway binds the workers' context length), and the most
        # characters one token stands for: the size check before any work per token
        self.prompt_bound = prompt_bound or PromptBound()
        self.chars_per_token = max_chars_per_token or chars_per_token(tokenizer)
        self.index = index
        self.feeder = feeder
        self.canary = canary
        if canary is not None:
            canary.feed_of = lambda name: feed_progress(self.subscribers, name)
        self.agreement = agreement
        self.subscribers = tuple(subscribers)
        self.store = store
        self.instances = {i[0]: i for i in instances}
        self.forward_token_ids = forward_token_ids
        self.keep_token_ids = keep_token_ids  # PromptAnalysis.token_ids (peer pulls stage by them)
        self.events_silence_s = events_silence_s
        self._ctx = zmq_context
        self._watchdog: asyncio.Task[None] | None = None
        self._gone: set[str] = set()
        self._pending: set[asyncio.Task[None]] = set()
        self._index_failures = 0
        # for instances added at run time (add_instance): how their subscribers catch up
        self._replay_timeout_s, self._replay_on_start = replay_timeout_s, replay_on_start
        self._event_bounds = event_bounds  # what a publisher may send (KVAwarenessSettings.event_bounds)
        self.collector: KVEventsCollector | None = None  # its lists follow membership changes
        self._started = False

    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size now, None while unknown (analysis.KnowsVocabulary)."""
        return (self._vocabulary.vocab_size or None) if self._vocabulary is not None else None

    async def add_instance(self, name: str, role: Role, url: str, events: KVEventsEndpoint | None) -> None:
        """An instance joined: known to the watchdog, and its KV events subscribed when it has an endpoint."""
        self.instances[name] = (name, role, url)
        subs: list[EventSubscriber] = []
        if events is not None:
            if self._ctx is None:  # no instance had events at start-up
                self._ctx = zmq.asyncio.Context()
            subs = subscribers_for(
                name,
                url,
                events,
                self.canary or self.feeder,
                self._ctx,
                replay_timeout_s=self._replay_timeout_s,
                catch_up=self._replay_on_start,
                bounds=self._event_bounds,
            )
            if self._started:  # else start() starts them with the others
                await start_subscribers(subs)
        self.subscribers = (*self.subscribers, *subs)
        self._sync_collector(name, role, added=True)
        if self._started and self.canary is not None and role != Role.DECODE:
            self.canary.schedule(name, url, first_address(subs, name))
        if self._started and self.subscribers and self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="kv-events-watchdog")

    async def remove_instance(self, name: str) -> None:
        """An instance left: its subscribers stop first (no event may re-add what is dropped next),
        then the index forgets every block it held."""
        info = self.instances.pop(name, None)
        leaving = [sub for sub in self.subscribers if sub.source.instance == name]
        self.subscribers = tuple(sub for sub in self.subscribers if sub.source.instance != name)
        for sub in leaving:
            await sub.close()
        if self.canary is not None:
            self.canary.forget(name)
        self._gone.discard(name)
        self._sync_collector(name, info[1] if info else Role.DECODE, added=False)
        await self.feeder.on_resync(name, "instance removed")

    def _sync_collector(self, name: str, role: Role, *, added: bool) -> None:
        if self.collector is None:
            return
        self.collector.subscribers = self.subscribers
        others = tuple(i for i in self.collector.instances if i != name)
        self.collector.instances = (*others, name) if added and role != Role.DECODE else others

    async def start(self) -> None:
        if isinstance(self.index, GuardedIndex):
            await self.index.probe()  # never raises: a Redis absent now is picked up when it answers
        await start_subscribers(self.subscribers)  # a socket that cannot open: ConfigError
        self._started = True
        if isinstance(self.store, MooncakeStoreProbe):
            await self.store.start()
        if self.subscribers:
            self._watchdog = asyncio.create_task(self._watch(), name="kv-events-watchdog")
        if self.canary is not None:  # the first requests find the instances verified (or not)
            cached_here = [(n, u, first_address(self.subscribers, n)) for n, r, u in self.instances.values() if r != Role.DECODE]
            await self.canary.first_runs(cached_here)

    async def close(self) -> None:
        if self.canary is not None:
            await self.canary.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        await asyncio.gather(*self._pending, return_exceptions=True)
        for sub in self.subscribers:
            await sub.close()
        if self.store is not None:
            await self.store.close()
        await self.tokenizer.close()
        await self.index.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def analyse(self, kind: RequestKind, body: Mapping[str, Any]) -> PromptAnalysis:
        """Tokenize, key and look up the prompt; 400 when it is longer than the model's context
        (its size checked before any of that, its token count before it is keyed)."""
        limit = self.prompt_bound.limit(body.get("model"))
        size = check_prompt_size(kind, body, limit, self.chars_per_token)
        try:
            ids, from_text = await self.encoder.token_ids(kind, body, size)
        except ConductorError as exc:  # a worker's /tokenize down must not fail the request
            log.warning("tokenizing failed, estimating instead: %s", exc.message)
            ids, from_text = None, False
        except Exception as exc:
            # is what vLLM answers 400 for too: the client's messages, not the gateway, are at fault
            log.debug("tokenizer rejected the request", exc_info=True)
            raise BadRequest(f"the prompt could not be tokenized: {type(exc).__name__}: {str(exc)[:200]}") from None
        if ids is None:
            tokens, exact = estimate_prompt_tokens(kind, body)
            return PromptAnalysis(prompt_tokens=tokens, exact=exact)
        check_token_count(kind, len(ids), limit)
        model = body.get("model")
        adapter = self.adapter_for(model) if self.adapter_for is not None and isinstance(model, str) else None
        keys, store_hashes = await self.encoder.keys(ids, store=self.store is not None, adapter=adapter)
        try:
            match = await self.index.match(keys)
        except Exception as exc:  # noqa: BLE001  # a shared index being down must not fail requests
            self._index_failures += 1
            if self._index_failures & (self._index_failures - 1) == 0:  # 1st, 2nd, 4th, 8th...: not a flood
                log.warning("KV index lookup failed (%d so far), routing without cache knowledge: %r", self._index_failures, exc)
            match = PrefixMatch()
        store_tokens = 0
        if self.store is not None and store_hashes:
            store_tokens = await self.store.leading_blocks(store_hashes, keys) * self.scheme.block_size
        kept = tuple(ids) if self.keep_token_ids else None
        forward = (kept or tuple(ids)) if from_text and self.forward_token_ids and kind == "completions" else None
        return PromptAnalysis(
            prompt_tokens=len(ids),
            exact=True,
            block_keys=tuple(keys),
            cached=self._visible(match.cached(self.scheme.block_size, len(ids))),
            store_cached_tokens=store_tokens,
            forward_token_ids=forward,
            token_ids=kept,
        )

    def _visible(self, cached: Mapping[str, CachedPrefix]) -> Mapping[str, CachedPrefix]:
        """What placement may count on: not the caches of instances whose canary has not passed."""
        return cached if self.canary is None else self.canary.visible(cached)

    async def on_dispatch(self, analysis: PromptAnalysis, decision: Decision) -> None:
        if decision.rejected or decision.prefill is None or not analysis.block_keys:
            return
        if decision.prefilled_on_decode:  # the index follows prefill instances only
            return
        if isinstance(self.index, MemoryIndex) or len(self._pending) >= self.MAX_PENDING_DISPATCHES:
            # in-process inserts are quick; a remote index falls back to waiting when too far behind
            try:
                await self.feeder.on_dispatch(decision.prefill, analysis.block_keys)
            except Exception as exc:  # noqa: BLE001  # bookkeeping must not fail the request
                log.warning("recording a dispatch in the KV index failed: %r", exc)
            return
        # A remote (Redis) insert of a long prompt is a round trip of milliseconds that the
        # request need not wait for: the bookkeeping runs beside it, bounded in number.
        task = asyncio.create_task(self.feeder.on_dispatch(decision.prefill, analysis.block_keys))
        self._pending.add(task)
        task.add_done_callback(self._dispatch_done)

    def _dispatch_done(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("recording a dispatch in the KV index failed: %r", task.exception())

    def on_result(self, analysis: PromptAnalysis, decision: Decision, observation: Observation) -> None:
        if not (observation.ok and analysis.block_keys):
            return
        # what the chosen instance holds after the pull the gateway carried out (relay.dispatch: its
        # own cache, or that plus a readback or a staged peer pull; its own alone when the pull failed)
        predicted = observation.predicted_cached_tokens
        self.agreement.observe(
            predicted,
            observation.cached_tokens,
            instance=observation.prefill or "",
            prompt_tokens=analysis.prompt_tokens if analysis.exact else None,
            reported_prompt_tokens=observation.reported_prompt_tokens,
        )

    def evidence(self, instance: str) -> FeedEvidence:
        """What the KV event feed of `instance` has shown, for the agreement diagnosis."""
        subs = [sub for sub in self.subscribers if sub.source.instance == instance]
        feed = self.feeder.instance(instance)
        return FeedEvidence(
            configured=bool(subs),
            endpoint=subs[0].address if subs else None,
            batches=sum(sub.stats.batches for sub in subs),
            hash_checked=feed.hash_checked,
            hash_mismatched=feed.hash_mismatched,
            last_mismatch=feed.last_mismatch,
            orphans=feed.orphans,
            block_size_mismatched=feed.block_size_mismatched,
        )

    async def _watch(self) -> None:
        """Drop instances whose events stopped and whose /health fails; they come back with events."""
        await watch_silent_instances(
            lambda: self.subscribers,
            lambda: {name: info[2] for name, info in self.instances.items()},
            self._gone,
            lambda name: self.feeder.on_resync(name, "instance gone"),
            self.events_silence_s,
        )


def build_analyzer(
    options: Mapping[str, Any] | KVAwarenessSettings,
    instances: Sequence[InstanceInfo],
    registry: CollectorRegistry | None = None,
    *,
    prompt_bound: PromptBound | None = None,
    adapter_for: Callable[[str], AdapterCard | None] | None = None,
    instance_adapter: Callable[[str, str], AdapterCard | None] | None = None,
) -> PromptAnalyzer:
    """The analyzer the settings describe. `instances` are (id, role, base URL); `prompt_bound`: how
    many tokens a prompt may have (the default when None); `adapter_for`: the LoRA adapter a
    request's model names; `instance_adapter`: the adapter an instance lists under a name (its
    KV events name the adapter, never its path); call `start()` next."""
    s = options if isinstance(options, KVAwarenessSettings) else KVAwarenessSettings.model_validate(options)
    scheme = make_scheme(s.key_mode, s.block_size, seed=s.hash_seed, algo=s.vllm_hash_algo, vllm_seed=s.vllm_hash_seed)
    index = make_index(s, registry)
    feeder = IndexFeeder(
        index,
        scheme,
        translate=s.key_mode == "xxhash",
        max_mapped_per_instance=mapped_within(s.hash_map_memory_bytes_per_instance),
        adapter_of=instance_adapter or (None if adapter_for is None else lambda _, name: adapter_for(name)),
    )
    if registry is not None:
        register_kv_memory(registry, index_memory(index), feeder.map_memory)
    urls = {iid: url for iid, _, url in instances}
    unknown = set(s.kv_events) - set(urls)
    if unknown:
        raise ConfigError(f"kv.kv_events names unknown instances: {sorted(unknown)}")
    # with an indexer, it ingests the events: this gateway subscribes to none
    ctx = zmq.asyncio.Context() if s.kv_events and s.index != "indexer" else None
    canary = build_canary(s, scheme, feeder, tokenizer := make_tokenizer(s, instances), registry)
    subscribers: list[EventSubscriber] = []
    if ctx is not None:
        for iid, ep in s.kv_events.items():
            subscribers += subscribers_for(
                iid,
                urls[iid],
                ep,
                canary or feeder,
                ctx,
                replay_timeout_s=s.replay_timeout_s,
                catch_up=s.replay_on_start,
                bounds=s.event_bounds(),
            )
    store = MooncakeStoreProbe(s.mooncake) if s.mooncake is not None else None
    agreement = build_agreement(s, registry)
    analyzer = KVAwareAnalyzer(
        tokenizer=tokenizer,
        scheme=scheme,
        index=index,
        feeder=feeder,
        agreement=agreement,
        subscribers=subscribers,
        store=store,
        instances=instances,
        forward_token_ids=s.forward_token_ids,
        events_silence_s=s.events_silence_s,
        zmq_context=ctx,
        replay_timeout_s=s.replay_timeout_s,
        replay_on_start=s.replay_on_start,
        event_bounds=s.event_bounds(),
        prefix_memo=prefix_memo(s, scheme),
        keep_token_ids=s.keep_token_ids,
        prompt_bound=prompt_bound,
        max_chars_per_token=s.max_chars_per_token,
        adapter_for=adapter_for,
        canary=canary,
    )
    if isinstance(analyzer.tokenizer, AutoTokenizer) and not s.tokenizer_url:  # workers that join later count too
        live = analyzer.instances
        analyzer.tokenizer.candidates = lambda: [u for _, role, u in live.values() if role != Role.DECODE]
    if s.index != "indexer":  # the feeds' evidence is the indexer's there, not ours
        agreement.set_evidence(analyzer.evidence)
    if registry is not None:
        cached_here = [iid for iid, role, _ in instances if role != Role.DECODE]
        analyzer.collector = KVEventsCollector(subscribers, feeder, cached_here)
        registry.register(analyzer.collector)
    warn_about_setup(s, instances)
    return analyzer
