"""The gateway's /v1/models passes on the cards its workers list (vLLM's ModelCard fields), with
the smallest max_model_len of the workers that serve a model; emulated workers over HTTP."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings, merge_settings
from conductor.gateway import Gateway
from tests.support.emulator import start_emulator
from tests.support.servers import serve_gateway
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)


def _cards(url: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(url + "/v1/models", timeout=30).json()
    assert body["object"] == "list"
    return {card["id"]: card for card in body["data"]}


def test_models_carry_the_workers_cards_with_the_smallest_context() -> None:
    with ExitStack() as stack:
        big = stack.enter_context(start_emulator("mixed", model="tiny", max_model_len=4096))
        small = stack.enter_context(start_emulator("mixed", model="tiny", max_model_len=2048))
        other = stack.enter_context(start_emulator("mixed", model="other", max_model_len=1024))
        worker_card = _cards(big.url)["tiny"]
        assert worker_card["max_model_len"] == 4096 and worker_card["owned_by"] == "vllm"  # what vLLM lists
        settings = merge_settings({"health": {"interval_s": 0.2}}, {"mixed": [big.url, small.url, other.url]})
        server = stack.enter_context(serve_gateway(Gateway(load_settings(environ={}, overrides=settings))))
        # the probes read each worker's cards once it is healthy: wait until all three have been read
        assert wait_for(
            lambda: {"tiny", "other"} <= set(_cards(server.url)) and _cards(server.url)["tiny"].get("max_model_len") == 2048,
            timeout=120,
        ), _cards(server.url)
        cards = _cards(server.url)
        tiny = cards["tiny"]
        for key in ("owned_by", "root", "parent", "permission"):
            assert tiny[key] == worker_card[key], key
        assert tiny["object"] == "model" and isinstance(tiny["created"], int)
        assert tiny["max_model_len"] == 2048  # the smaller of 4096 and 2048: any of them may serve it
        assert cards["other"]["max_model_len"] == 1024 and cards["other"]["root"] == "other"


def test_a_configured_model_no_worker_listed_gets_a_bare_card() -> None:
    from conductor.fleet.model_cards import model_list

    body = model_list(["configured"], [], created=7)
    assert body == {"object": "list", "data": [{"id": "configured", "object": "model", "created": 7, "owned_by": "conductor"}]}
