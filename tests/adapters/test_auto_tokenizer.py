"""kv.tokenizer "auto" (adapters/auto_tokenizer.py): the first worker that answers decides, a worker's
/tokenize or the byte tokenizer; nobody answering leaves it undecided; once a worker has served
/tokenize the byte tokenizer is never taken. Against an emulated vLLM (it serves /tokenize) and a
stand-in without the route, on real sockets."""

from __future__ import annotations

import pytest

from adapters.auto_tokenizer import AutoTokenizer
from conductor.core.errors import UpstreamError
from conductor.core.tokenization import ByteTokenizer
from tests.support.emulator import start_emulator
from tests.support.ports import free_port
from tests.support.servers import serve
from tests.support.standin import StandIn

pytestmark = pytest.mark.timeout(300)  # an emulator subprocess on a busy box: a bound, not a speed check
TEXT = "héllo, wörld"


async def test_nobody_answering_leaves_it_undecided_until_a_worker_without_tokenize_answers() -> None:
    port = free_port()
    urls = [f"http://127.0.0.1:{port}"]  # nothing listens there yet
    tokenizer = AutoTokenizer(lambda: urls, retry_s=0)
    try:
        with pytest.raises(UpstreamError, match="no worker answered /tokenize"):
            await tokenizer.encode_prompt(TEXT)
        assert tokenizer.source == "undecided" and tokenizer.vocab_size is None
        with serve(StandIn(model="tiny"), port=port):  # up now, and it has no /tokenize
            assert await tokenizer.encode_prompt(TEXT) == ByteTokenizer().encode(TEXT)
        assert tokenizer.source == "builtin" and tokenizer.vocab_size == ByteTokenizer.vocab_size
    finally:
        await tokenizer.close()


async def test_a_worker_that_served_tokenize_is_never_replaced_by_the_byte_tokenizer() -> None:
    urls: list[str] = []
    tokenizer = AutoTokenizer(lambda: urls, retry_s=0)
    try:
        with serve(StandIn(model="tiny")) as no_route:
            with start_emulator("mixed", model="tiny") as emu:
                urls[:] = [f"http://127.0.0.1:{free_port()}", emu.url]  # the first is down: the next one decides
                assert await tokenizer.encode_prompt(TEXT) == ByteTokenizer().encode(TEXT)  # the emulator's bytes
                assert tokenizer.source == emu.url
            urls[:] = [emu.url, no_route.url]  # the emulator has exited
            with pytest.raises(UpstreamError):  # the chosen worker is gone: this prompt is estimated
                await tokenizer.encode_prompt(TEXT)
            with pytest.raises(UpstreamError, match=rf"{no_route.url}: answered 404"):
                await tokenizer.encode_prompt(TEXT)  # a worker without the route is no substitute now
            assert tokenizer.source == emu.url
    finally:
        await tokenizer.close()
