"""conductor/routing/batching.py: a completions batch split into one request per prompt, the answers merged.

The merges are fed real bytes: SSE streams cut at awkward places (inside JSON, between the two
newlines of a separator, CRLF separators), interleaved across prompts; and, end to end, emulated
vLLM workers over real sockets (a mixed engine as the truth, a NIXL prefill + decode pair driven by
hand with split/merge, and the old one-batched-request way, which the emulator shows to be wrong).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest

from conductor.core.errors import UpstreamError
from conductor.routing.batching import StreamMerger, merge_replies, split_prompts, sum_usage
from tests.support.emulator import Emulator, start_emulator

HEAD = {"id": "cmpl-a", "object": "text_completion", "created": 7, "model": "m"}


def chunk(text: str, finish: str | None = None, index: int = 0, head: dict[str, Any] = HEAD) -> dict[str, Any]:
    return {**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}]}


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    details = None if cached is None else {"cached_tokens": cached}
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }


def sse(objs: list[dict[str, Any]], use: dict[str, Any] | None, sep: bytes = b"\n\n", head: dict[str, Any] = HEAD) -> bytes:
    """A vLLM completions stream: token chunks, the usage-only chunk when asked, [DONE]."""
    events = [b"data: " + json.dumps(o).encode() for o in objs]
    if use is not None:
        events.append(b"data: " + json.dumps({**head, "choices": [], "usage": use}).encode())
    events.append(b"data: [DONE]")
    return b"".join(e + sep for e in events)


def awkward_cuts(raw: bytes, seed: int) -> list[bytes]:
    """`raw` in pieces of 1-9 bytes, with a cut between the two bytes of every blank line too."""
    rng = random.Random(seed)
    cuts = {i + 1 for i in range(len(raw) - 1) if raw[i : i + 2] == b"\n\n" or raw[i : i + 2] == b"\r\n"}
    pos = 0
    while pos < len(raw):
        pos += rng.randint(1, 9)
        cuts.add(pos)
    edges = [0, *sorted(c for c in cuts if 0 < c < len(raw)), len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(edges)]


async def pieces(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(0)  # let the other streams' readers run between pieces
        yield part


class Feed:
    """A byte stream the test drives by hand; records whether it was closed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.closed = False

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            while (item := await self.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


def parse(out: bytes) -> list[Any]:
    """A merged stream as a client parses it: events at blank lines, data JSON (or "[DONE]")."""
    assert out.endswith(b"\n\n")
    events = out[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[6:].decode() if e == b"data: [DONE]" else json.loads(e[6:]) for e in events]


async def collect(merger: StreamMerger) -> bytes:
    return b"".join([part async for part in merger])


# -- split_prompts --------------------------------------------------------------------------------


def test_split_prompts_batches_only() -> None:
    body = {
        "model": "m",
        "prompt": ["hello world", "the cache"],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts = split_prompts(body)
    assert parts == [{**body, "prompt": "hello world"}, {**body, "prompt": "the cache"}]
    assert body["prompt"] == ["hello world", "the cache"]  # the client's body is left alone
    ids = split_prompts({"prompt": [[1, 2, 3], [4, 5]], "n": 2})
    assert ids == [{"prompt": [1, 2, 3], "n": 2}, {"prompt": [4, 5], "n": 2}]  # token ids stay token ids
    for single in ("text", [1, 2, 3], ["one"], [[1, 2]], [], None, ["a", [1]], [1, "a"]):
        assert split_prompts({"prompt": single}) is None, single
    assert split_prompts({"messages": [{"role": "user", "content": "hi"}]}) is None


# -- merge_replies ----------------------------------------------------------------------------------


def reply(i: int, texts: list[str], use: dict[str, Any] | None, **extra: Any) -> bytes:
    body = {
        "id": f"cmpl-{i}",
        "object": "text_completion",
        "created": 100 + i,
        "model": "m",
        "choices": [
            {"index": j, "text": t, "logprobs": None, "finish_reason": "length", "stop_reason": None} for j, t in enumerate(texts)
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": use,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[i]]},
        **extra,
    }
    return msgspec.json.encode(body)


def test_merge_replies_field_by_field() -> None:
    merged = json.loads(merge_replies([reply(0, [" a b"], usage(11, 2, 0)), reply(1, [" c d"], usage(9, 2, 8))]))
    assert merged["id"] == "cmpl-0" and merged["created"] == 100 and merged["model"] == "m"
    assert merged["object"] == "text_completion" and merged["system_fingerprint"] is None
    assert "kv_transfer_params" not in merged
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, " a b"), (1, " c d")]
    assert all(c["finish_reason"] == "length" for c in merged["choices"])
    assert merged["usage"] == {
        "prompt_tokens": 20,
        "total_tokens": 24,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_merge_replies_n_choices_and_usage_forms() -> None:
    merged = json.loads(
        merge_replies(
            [
                reply(0, ["a", "b"], usage(3, 2, None)),
                reply(1, ["c", "d"], usage(4, 2, None)),
                reply(2, ["e", "f"], usage(5, 2, None)),
            ]
        )
    )
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a"),
        (1, "b"),
        (2, "c"),
        (3, "d"),
        (4, "e"),
        (5, "f"),
    ]  # i * n + j
    assert merged["usage"] == {"prompt_tokens": 12, "total_tokens": 18, "completion_tokens": 6, "prompt_tokens_details": None}
    assert sum_usage([None, {"prompt_tokens": 2, "completion_tokens": 1}]) == {
        "prompt_tokens": 2,
        "total_tokens": 3,
        "completion_tokens": 1,
    }
    assert sum_usage([None, None]) is None
    assert json.loads(merge_replies([reply(0, ["x"], None)]))["usage"] is None


def test_merge_replies_rejects_what_is_not_a_completion() -> None:
    for bad in (b"not json", b"[1, 2]", b'{"id": "x"}'):
        with pytest.raises(UpstreamError):
            merge_replies([reply(0, ["a"], None), bad])
    with pytest.raises(ValueError):
        merge_replies([])


# -- StreamMerger -------------------------------------------------------------------------------------


async def test_streams_cut_anywhere_merge_with_indexes_usage_and_one_done() -> None:
    words = [[" the", " quick", " fox"], [" a", " lazy", " dog", " runs"], [" far"]]
    uses = [usage(11, 3, 0), usage(9, 4, 8), usage(30, 1, 16)]
    heads = [{**HEAD, "id": f"cmpl-{i}"} for i in range(3)]
    raws = [
        sse(
            [chunk(w, "length" if k == len(ws) - 1 else None, head=heads[i]) for k, w in enumerate(ws)],
            uses[i],
            sep=b"\r\n\r\n" if i == 1 else b"\n\n",
            head=heads[i],
        )
        for i, ws in enumerate(words)
    ]
    merger = StreamMerger([pieces(awkward_cuts(raw, seed=i)) for i, raw in enumerate(raws)], include_usage=True)
    events = parse(await collect(merger))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    final = events[-2]
    assert final == {
        **heads[0],
        "choices": [],
        "usage": {
            "prompt_tokens": 50,
            "total_tokens": 58,
            "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 24},
        },
    }
    tokens = events[:-2]
    assert all(e["choices"] for e in tokens)  # the sub-streams' usage-only chunks are gone
    for i, ws in enumerate(words):
        mine = [e for e in tokens if e["choices"][0]["index"] == i]
        assert [e["choices"][0]["text"] for e in mine] == ws
        assert all(e["id"] == f"cmpl-{i}" for e in mine)  # nothing but the index is rewritten
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    assert (merger.prompt_tokens, merger.completion_tokens, merger.cached_tokens) == (50, 8, 24)


async def test_events_are_relayed_as_they_arrive_interleaved() -> None:
    a, b = Feed(), Feed()
    merger = StreamMerger([a.stream(), b.stream()], include_usage=False)
    it = aiter(merger)
    a0 = b"data: " + json.dumps(chunk(" one")).encode()
    a.queue.put_nowait(a0[:17])
    a.queue.put_nowait(a0[17:] + b"\n")  # the event is complete only with its second newline
    a.queue.put_nowait(b"\ndata: " + json.dumps(chunk(" tw")).encode()[:5])
    first = await asyncio.wait_for(anext(it), 10)  # a guard against a hang, not a timing check
    assert first == a0 + b"\n\n"  # prompt 0 with n=1: relayed byte for byte
    b.queue.put_nowait(b": keep-alive\n\ndata: " + json.dumps(chunk(" uno")).encode() + b"\n\n")
    assert await asyncio.wait_for(anext(it), 10) == b": keep-alive\n\n"  # comments pass through
    second = parse(await asyncio.wait_for(anext(it), 10))[0]
    assert second["choices"][0]["index"] == 1 and second["choices"][0]["text"] == " uno"
    a.queue.put_nowait(json.dumps(chunk(" tw")).encode()[5:] + b"\n\n")
    assert parse(await asyncio.wait_for(anext(it), 10))[0]["choices"][0]["text"] == " tw"
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    b.queue.put_nowait(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
    assert parse(await asyncio.wait_for(anext(it), 10)) == [error]  # relayed; prompt 0 goes on
    b.queue.put_nowait(None)
    a.queue.put_nowait(b"data: " + json.dumps({**HEAD, "choices": [], "usage": usage(3, 2, 0)}).encode() + b"\n\n")
    a.queue.put_nowait(b"data: [DONE]\n\n")
    a.queue.put_nowait(None)
    rest = [part async for part in it]
    assert rest == [b"data: [DONE]\n\n"]  # include_usage False: no usage chunk, the sums kept all the same
    assert merger.usage == usage(3, 2, 0)


async def test_n_choices_per_prompt_and_a_last_event_without_blank_line() -> None:
    streams = [
        pieces([b"data: " + json.dumps(chunk("x", index=j)).encode() + b"\n\n" for j in (0, 1)]),
        pieces([b"data: " + json.dumps(chunk("y", index=1)).encode()]),
    ]  # ends without "\n\n"
    events = parse(await collect(StreamMerger(streams, include_usage=True, n=2)))
    assert sorted(e["choices"][0]["index"] for e in events[:-1]) == [0, 1, 3]
    assert events[-1] == "[DONE]"  # no sub-stream reported usage: no usage chunk


async def test_a_failing_stream_closes_the_others_and_raises() -> None:
    a, b = Feed(), Feed()
    merger = StreamMerger([a.stream(), b.stream()], include_usage=True)
    it = aiter(merger)
    a.queue.put_nowait(b"data: " + json.dumps(chunk(" one")).encode() + b"\n\n")
    await asyncio.wait_for(anext(it), 10)
    b.queue.put_nowait(ConnectionResetError("decode leg reset"))
    with pytest.raises(ConnectionResetError, match="decode leg reset"):
        await asyncio.wait_for(anext(it), 10)
    assert a.closed and b.closed


async def test_closing_the_merger_closes_every_stream() -> None:
    a, b = Feed(), Feed()
    merger = StreamMerger([a.stream(), b.stream()], include_usage=True)
    a.queue.put_nowait(b"data: " + json.dumps(chunk(" one")).encode() + b"\n\n")
    await asyncio.wait_for(anext(aiter(merger)), 10)
    await merger.aclose()
    assert a.closed and b.closed
    # Cancelling the task that iterates it (a client that went away) closes them too.
    c, d = Feed(), Feed()
    waiting = asyncio.get_running_loop().create_task(anext(aiter(StreamMerger([c.stream(), d.stream()], include_usage=False))))
    for _ in range(5):
        await asyncio.sleep(0)  # the merger is now waiting for its streams' first bytes
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert c.closed and d.closed
    # A merger never iterated still closes streams the caller had already started reading.
    e = Feed()
    started = e.stream()
    e.queue.put_nowait(b"x")
    assert await anext(started) == b"x"
    await StreamMerger([started, Feed().stream()], include_usage=False).aclose()
    assert e.closed


# -- end to end on emulated vLLM workers -------------------------------------------------------------

NIXL_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
BATCH = {"model": "emulated", "prompt": ["hello world", "the cache"], "max_tokens": 8}


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Emulator, Emulator, Emulator]]:
    with (
        start_emulator("mixed", time_scale=0.01) as m,
        start_emulator("prefill", "nixl", time_scale=0.01) as p,
        start_emulator("decode", "nixl", time_scale=0.01) as d,
    ):
        yield m, p, d


async def prefill(client: httpx.AsyncClient, p: Emulator, body: dict[str, Any]) -> Any:
    """vLLM's NIXL prefill leg: one token, not streamed, the connector's request params."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    r = await client.post(
        p.url + "/v1/completions", json={**leg, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_PREFILL}
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


async def streamed(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for data in r.aiter_bytes():
            for part in awkward_cuts(data, seed=len(data)):  # smaller still than the socket's reads
                yield part


async def test_split_legs_merged_equal_the_mixed_engine_and_one_batch_does_not(
    workers: tuple[Emulator, Emulator, Emulator],
) -> None:
    m, p, d = workers
    async with httpx.AsyncClient(timeout=30) as client:
        truth = (await client.post(m.url + "/v1/completions", json=BATCH)).json()
        texts = [c["text"] for c in truth["choices"]]
        assert texts[0] != texts[1]
        parts = split_prompts(BATCH)
        assert parts is not None
        # The fix: each prompt its own prefill leg, its own params to its own decode leg, merged.
        params = await asyncio.gather(*(prefill(client, p, part) for part in parts))
        replies = await asyncio.gather(
            *(
                client.post(d.url + "/v1/completions", json={**part, "kv_transfer_params": kv})
                for part, kv in zip(parts, params, strict=True)
            )
        )
        merged = json.loads(merge_replies([r.content for r in replies]))
        assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, texts[0]), (1, texts[1])]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert merged["usage"][key] == truth["usage"][key]
        assert merged["usage"]["prompt_tokens_details"]["cached_tokens"] == 20  # all KV came from the prefill
        assert "kv_transfer_params" not in merged
        # Streamed the same way: decode legs merged as they stream.
        stream_parts = split_prompts({**BATCH, "stream": True, "stream_options": {"include_usage": True}})
        assert stream_parts is not None
        params = [await prefill(client, p, part) for part in stream_parts]
        merger = StreamMerger(
            [streamed(client, d.url, {**part, "kv_transfer_params": kv}) for part, kv in zip(stream_parts, params, strict=True)],
            include_usage=True,
        )
        events = parse(await collect(merger))
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert events[-2]["usage"]["completion_tokens"] == 16 and events[-2]["usage"]["prompt_tokens"] == 20
        for i in (0, 1):
            assert "".join(e["choices"][0]["text"] for e in events[:-2] if e["choices"][0]["index"] == i) == texts[i]
        assert (merger.prompt_tokens, merger.completion_tokens, merger.cached_tokens) == (20, 16, 20)
        # The old way: one batched prefill, its one kv_transfer_params to one batched decode.
        old_params = await prefill(client, p, BATCH)
        old = (await client.post(d.url + "/v1/completions", json={**BATCH, "kv_transfer_params": old_params})).json()
        old_texts = [c["text"] for c in old["choices"]]
        assert old_texts[0] == texts[0] and old_texts[1] != texts[1]
        assert old_texts[1] == texts[0]  # prompt 1 continued prompt 0's KV
