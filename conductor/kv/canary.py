"""The KV canary: an instance's KV events checked against the gateway's block keys before its cache
is trusted for placement.

When an instance joins (start-up, DNS, the admin API) or its engine restarted (its event sequence
went back, or a gap could not be replayed: `on_resync`), the gateway sends it a short prompt of
random token ids (max_tokens 1), waits up to kv.canary_timeout_s for the BlockStored event of that
prompt's first blocks and judges it (conductor/kv/canary_checks.py): block size, hash algorithm and
seed ("vllm" key mode), extra keys, delivery; then, when the gateway tokenizes text itself, a text
prompt whose event's token ids must be the gateway's own (the tokenizer). A canary whose events were
lost to ZMQ's slow joiner is sent again with fresh tokens, kv.canary_attempts times in all.

Until an instance is verified, and while it fails, its entries in the index are ignored when
placing requests (`visible`: the policy sees no cached prefix there, so it is placed by load like
any cold instance); it keeps serving. Each run ends in one log line naming the setting to fix, a
count in conductor_kv_canary_total{instance,result}, and its state in /ready's `kv_canary` detail.
An instance with no KV events endpoint is reported (no_events) but not excluded: its entries are the
gateway's own dispatches, keyed as the gateway keys them.

A restart's first event drops the instance's entries at once (the subscriber's resync, before the canary is even sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry

from adapters.kv_event_batch import BlockStored, EventBatch
from adapters.tokenizers import PromptTokenizer
from conductor.config.kv import KVAwarenessSettings
from conductor.core.block_keys import BlockKeyScheme
from conductor.core.types import CachedPrefix
from conductor.kv.canary_checks import (
    RESULTS,
    KeySetup,
    Verdict,
    canary_text,
    canary_tokens,
    judge,
    late_start,
    no_events,
    starts_prompt,
    tokenizer_verdict,
)
from conductor.kv.canary_io import CanaryMetrics, complete, served_model

log = logging.getLogger(__name__)

MAX_INSTANCES = 4096  # states kept; instances come from the settings, DNS or the admin API: a backstop
RETRY_MAX_S = 30.0  # an unreachable instance is tried again after timeout_s, doubling up to this
# the canaries one run sends in turn: (a prompt's token ids, its request)
Sends = AsyncGenerator[tuple[list[int], Awaitable[None]], None]


class EventSink(Protocol):
    async def on_batch(self, instance: str, batch: EventBatch) -> None: ...

    async def on_resync(self, instance: str, reason: str = "") -> None: ...


@dataclass(slots=True)
class CanaryState:
    """One instance's canary: `state` pending (running, excluded), verified, failed (excluded) or
    unverifiable (no events endpoint: reported, not excluded)."""

    state: str = "pending"
    result: str | None = None
    detail: str = ""
    runs: int = 0
    settled: int = 0  # verdicts given (runs that reached the instance)
    since: float = 0.0  # time.monotonic() the current run was asked for
    seconds: float | None = None  # how long the last finished run took, from its ask

    @property
    def excluded(self) -> bool:
        return self.state in ("pending", "failed")


class KVCanary:
    """Runs the canaries, holds each instance's state, and sits between the KV event subscribers and
    the index feeder (`on_batch`, `on_resync`) to see the canaries' events and the restarts."""

    def __init__(
        self,
        sink: EventSink,
        scheme: BlockKeyScheme,
        setup: KeySetup,
        *,
        tokenizer: PromptTokenizer | None,
        tokenizer_name: str,
        timeout_s: float,
        attempts: int,
        enabled: bool = True,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.sink, self.scheme, self.setup = sink, scheme, setup
        self.tokenizer, self.tokenizer_name = tokenizer, tokenizer_name
        self.timeout_s, self.attempts, self.enabled = timeout_s, max(1, attempts), enabled
        self.headers: dict[str, str] = {}  # the upstream key, set by the fleet's membership
        # instance -> (batches applied, last seq, replay endpoint known): how much of its feed was missed
        self.feed_of: Callable[[str], tuple[int, int | None, bool]] = lambda _: (0, None, False)
        self.states: dict[str, CanaryState] = {}
        self._excluded: frozenset[str] = frozenset()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._outcomes: dict[str, asyncio.Future[None]] = {}  # set at a run's first outcome (start-up waits)
        self._waiters: dict[str, list[tuple[Callable[[BlockStored], bool], asyncio.Future[BlockStored]]]] = {}
        self._client: httpx.AsyncClient | None = None
        self._urls: dict[str, str] = {}  # where each instance's canary goes, for the re-runs
        self._endpoints: dict[str, str | None] = {}
        self._metrics = CanaryMetrics(registry or CollectorRegistry())

    # ---- what the request path and the feeds call ------------------------------------------------
    def visible(self, cached: Mapping[str, CachedPrefix]) -> Mapping[str, CachedPrefix]:
        """`cached` without the instances kept out of KV-aware placement."""
        excluded = self._excluded
        if not excluded or not cached:
            return cached
        return {name: prefix for name, prefix in cached.items() if name not in excluded}

    async def on_batch(self, instance: str, batch: EventBatch) -> None:
        await self.sink.on_batch(instance, batch)  # indexed first: verified means it is in the index
        waiters = self._waiters.get(instance)
        if not waiters:
            return
        for ev in batch.events:
            if isinstance(ev, BlockStored) and ev.parent_block_hash is None:
                for wanted, future in waiters:
                    if not future.done() and wanted(ev):
                        future.set_result(ev)

    async def on_resync(self, instance: str, reason: str = "") -> None:
        """The subscriber lost the instance's sequence (a restart, a gap it could not replay): the
        index drops its entries now, and the instance is checked again before it is trusted."""
        await self.sink.on_resync(instance, reason)
        if instance in self.states and self.enabled:
            log.info("KV canary: %s is checked again (%s)", instance, reason)
            self.schedule(instance, self._urls.get(instance, ""), self._endpoints.get(instance))

    # ---- runs ------------------------------------------------------------------------------------
    def schedule(self, instance: str, url: str, endpoint: str | None) -> asyncio.Task[None] | None:
        """(Re)start the instance's canary; its state is pending (excluded) until the verdict."""
        if not self.enabled or (instance not in self.states and len(self.states) >= MAX_INSTANCES):
            return None
        self._urls[instance], self._endpoints[instance] = url, endpoint
        old = self._tasks.pop(instance, None)
        if old is not None:
            old.cancel()
        state = self.states.setdefault(instance, CanaryState())
        state.state, state.since = "pending", time.monotonic()
        self._outcomes[instance] = asyncio.get_running_loop().create_future()
        if endpoint is None:  # nothing to check: reported, never excluded, no request sent
            self._settle(instance, no_events(None, 0, 0.0), None)
            return None
        self._changed()
        task = asyncio.create_task(self._run(instance, url, endpoint), name=f"kv-canary-{instance}")
        self._tasks[instance] = task
        task.add_done_callback(functools.partial(self._done, instance))
        return task

    async def first_runs(self, instances: Sequence[tuple[str, str, str | None]]) -> None:
        """At start-up: every (name, url, events address) checked, their verdicts waited for up to
        twice timeout_s (a run waits up to timeout_s for events, plus its requests and the text
        check); the gateway answers no request before start-up ends."""
        for name, url, endpoint in instances:
            self.schedule(name, url, endpoint)
        await self.wait(2 * self.timeout_s)

    async def wait(self, timeout_s: float) -> None:
        """Until every canary running now has an outcome (a verdict, or its instance did not answer:
        an engine still loading must not hold the gateway's start-up; it is tried again), or `timeout_s`."""
        outcomes = [f for f in self._outcomes.values() if not f.done()]
        if outcomes:
            await asyncio.wait(outcomes, timeout=timeout_s)
            for name, state in self.states.items():
                if state.state == "pending" and state.result is None:
                    log.info("KV canary: %s has no verdict yet: kept out of KV-aware placement meanwhile", name)

    def forget(self, instance: str) -> None:
        self._outcomes.pop(instance, None)
        self._urls.pop(instance, None)
        self._endpoints.pop(instance, None)
        task = self._tasks.pop(instance, None)
        if task is not None:
            task.cancel()
        if self.states.pop(instance, None) is not None:
            self._metrics.forget(instance, RESULTS)
            self._changed()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def _done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(name) is task:
            del self._tasks[name]
        if not task.cancelled() and task.exception() is not None:
            log.error("KV canary on %s failed: %r", name, task.exception())

    async def _run(self, name: str, url: str, endpoint: str) -> None:
        """Until the instance answers (doubling waits), then the verdict, settled once."""
        delay = self.timeout_s
        while True:
            verdict = await self._check(name, url, endpoint)
            if verdict.result != "unreachable":
                break
            self._count(name, verdict)
            state = self.states.get(name)
            if state is not None and state.runs == 1:
                log.warning("KV canary on %s: %s; tried again every %.0fs at most", name, verdict.detail, RETRY_MAX_S)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)
        self._settle(name, verdict, endpoint)

    async def _check(self, name: str, url: str, endpoint: str) -> Verdict:
        client = self._http()
        try:
            model = await served_model(client, url)
            verdict = await self._ids_check(name, client, url, model, endpoint)
            if verdict.ok and self.tokenizer is not None:
                text = await self._text_check(name, client, url, model)
                verdict = Verdict("verified", f"{verdict.detail}; {text.detail}") if text.ok else text
            state = self.states.get(name)
            if verdict.ok and state is not None and state.settled == 0:  # at its join only: a restart starts again from 0
                batches, last_seq, replay = self.feed_of(name)
                if last_seq is not None and last_seq + 1 > batches:
                    return late_start(last_seq + 1 - batches, replay)
            return verdict
        except (httpx.HTTPError, ValueError) as exc:
            return Verdict("unreachable", f"the canary request to {url} failed: {type(exc).__name__}: {str(exc)[:160]}")

    async def _ids_check(self, name: str, client: httpx.AsyncClient, url: str, model: str | None, endpoint: str) -> Verdict:
        """The token-id canary, sent again with fresh ids while no event of it arrives."""

        async def sends() -> Sends:
            for _ in range(self.attempts):
                tokens = canary_tokens(self.setup.block_size)
                yield tokens, complete(client, url, model, tokens)

        got = await self._expect(name, sends(), self.timeout_s / self.attempts)
        if got is None:
            return no_events(endpoint, self.attempts, self.timeout_s)
        return judge(got[0], got[1], self.scheme, self.setup)

    async def _text_check(self, name: str, client: httpx.AsyncClient, url: str, model: str | None) -> Verdict:
        """The text canary: the gateway's token ids of a text against the worker's (its event's),
        sent again with a fresh text while the worker counts as many tokens and no event arrives."""
        tokenizer = self.tokenizer
        assert tokenizer is not None
        sent: list[tuple[list[int], dict[str, Any]]] = []  # the gateway's token ids, the worker's usage

        async def sends() -> Sends:
            for _ in range(self.attempts):
                text = canary_text(self.setup.block_size)
                ids, usage = await tokenizer.encode_prompt(text), dict[str, Any]()
                sent.append((ids, usage))
                yield ids, complete(client, url, model, text, usage)

        def counted(i: int) -> int | None:
            tokens = sent[i][1].get("prompt_tokens")
            return tokens if isinstance(tokens, int) else None

        # a worker that counted another prompt length has other token ids: no event to wait for
        got = await self._expect(
            name, sends(), self.timeout_s / self.attempts, give_up=lambda: counted(-1) not in (None, len(sent[-1][0]))
        )
        i = -1 if got is None else next(i for i, (ids, _) in enumerate(sent) if ids is got[1])
        return tokenizer_verdict(sent[i][0], counted(i), None if got is None else got[0].token_ids, self.tokenizer_name)

    async def _expect(
        self,
        name: str,
        sends: Sends,
        wait_s: float,
        give_up: Callable[[], bool] | None = None,
    ) -> tuple[BlockStored, list[int]] | None:
        """Send canaries one after another, each awaited and then waited on up to `wait_s`, until
        the event that stores the first blocks of any prompt sent so far arrives: that event and its
        prompt. A late event of an earlier send still counts (a loaded box delivers seconds late).
        None when none came, or at once when `give_up` says, after an answer, that none will."""
        prompts: list[list[int]] = []
        future: asyncio.Future[BlockStored] = asyncio.get_running_loop().create_future()
        entry = (lambda ev: any(starts_prompt(ev, tokens) for tokens in prompts), future)
        self._waiters.setdefault(name, []).append(entry)
        try:
            async with contextlib.aclosing(sends):
                async for tokens, send in sends:
                    prompts.append(tokens)
                    await send
                    if give_up is not None and give_up() and not future.done():
                        return None
                    try:
                        ev = await asyncio.wait_for(asyncio.shield(future), wait_s)
                    except TimeoutError:
                        continue
                    return ev, next(tokens for tokens in prompts if starts_prompt(ev, tokens))
            return None
        finally:
            future.cancel()
            waiters = self._waiters.get(name, [])
            if entry in waiters:
                waiters.remove(entry)
            if not waiters:
                self._waiters.pop(name, None)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=max(self.timeout_s, 5.0), headers=self.headers)
        return self._client

    # ---- outcome ---------------------------------------------------------------------------------
    def _count(self, name: str, verdict: Verdict) -> None:
        state = self.states.get(name)
        if state is not None:
            state.runs += 1
            state.result, state.detail = verdict.result, verdict.detail
        self._metrics.runs.labels(name, verdict.result).inc()
        outcome = self._outcomes.pop(name, None)
        if outcome is not None and not outcome.done():
            outcome.set_result(None)

    def _settle(self, name: str, verdict: Verdict, endpoint: str | None) -> None:
        state = self.states.get(name)
        if state is None:
            return
        self._count(name, verdict)
        state.settled += 1
        state.seconds = round(time.monotonic() - state.since, 4)
        self._metrics.seconds.observe(state.seconds)
        if verdict.ok:
            state.state = "verified"
            log.info("KV canary on %s: verified in %.3fs (%s)", name, state.seconds, verdict.detail)
        elif verdict.result == "late_start":  # keyed right: trusted, and told
            state.state = "verified"
            log.warning("KV CANARY on %s [late_start]: %s", name, verdict.detail)
        elif endpoint is None:  # the operator's choice (the start-up log says so too): not a warning
            state.state = "unverifiable"
            log.info("KV canary on %s [%s]: %s", name, verdict.result, verdict.detail)
        else:
            state.state = "failed"
            log.warning(
                "KV CANARY FAILED on %s [%s]: %s. Its cache is left out of KV-aware placement (it still serves) "
                "until this is fixed.",
                name,
                verdict.result,
                verdict.detail,
            )
        self._changed()

    def _changed(self) -> None:
        self._excluded = frozenset(name for name, s in self.states.items() if s.excluded)
        self._metrics.unverified.set(len(self._excluded))
        for name, state in self.states.items():
            self._metrics.excluded.labels(name).set(1 if state.excluded else 0)

    def report(self) -> dict[str, Any]:
        """/ready's `kv_canary` detail."""
        return {
            "unverified": len(self._excluded),
            "instances": {
                name: {"state": s.state, "result": s.result, "detail": s.detail, "runs": s.runs, "seconds": s.seconds}
                for name, s in self.states.items()
            },
        }


def build_canary(
    s: KVAwarenessSettings,
    scheme: BlockKeyScheme,
    feeder: EventSink,
    tokenizer: PromptTokenizer,
    registry: CollectorRegistry | None,
) -> KVCanary | None:
    """The KV canary the settings ask for; None when turned off or when an indexer ingests the
    events (this gateway then sees none)."""
    if not s.canary or s.index == "indexer":
        return None
    setup = KeySetup(s.block_size, translate=s.key_mode == "xxhash", algo=s.vllm_hash_algo, seed=s.vllm_hash_seed)
    return KVCanary(
        feeder,
        scheme,
        setup,
        tokenizer=tokenizer,
        tokenizer_name=s.tokenizer,
        timeout_s=s.canary_timeout_s,
        attempts=s.canary_attempts,
        registry=registry,
    )
