"""Several models behind one gateway: a request goes only to the workers that serve its model (a base
model or a LoRA adapter, as their /v1/models say, or as the settings list), an alias is routed and
forwarded as the served name, an unknown model is a 404, and /v1/models lists models, adapters and
aliases. Stand-in workers that, like vLLM, answer 404 for a model they do not serve; real sockets."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings, merge_settings
from conductor.core.errors import ConfigError
from conductor.gateway import Gateway
from tests.support.prom import scrape
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

# round robin without the KV index unless a test says otherwise: where requests land is then the
# rotation's, and a request sent to a worker outside its pool shows as that worker's 404
BASELINE = {"policy": "round_robin", "kv": {"enabled": False, "tokenizer": "builtin"}, "health": {"interval_s": 0.5}}


@dataclass
class Fleet:
    url: str
    gateway: Gateway


@contextmanager
def _fleet(workers: dict[str, list[StandIn]], **settings: Any) -> Iterator[Fleet]:
    """The stand-ins `workers` (role -> workers) served, and a gateway in front of them, once every
    worker has answered its first probe (the gateway starts by probing them all)."""
    with ExitStack() as stack:
        overrides: dict[str, Any] = merge_settings(BASELINE, settings)
        for role, standins in workers.items():
            overrides[role] = [stack.enter_context(serve(w)).url for w in standins]
        gateway = Gateway(load_settings(environ={}, overrides=overrides))
        yield Fleet(stack.enter_context(serve_gateway(gateway)).url, gateway)


def _complete(url: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 2, **extra}, timeout=30
    )


def _models_of(worker: StandIn) -> Counter[str]:
    return Counter(body["model"] for body in worker.bodies())


def _cards(url: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(url + "/v1/models", timeout=30).json()
    return {card["id"]: card for card in body["data"]}


@pytest.mark.parametrize("policy", ["round_robin", "kvcache_aware"])
def test_each_request_lands_on_a_worker_serving_its_model(policy: str) -> None:
    llama, qwen = StandIn(models=("llama",)), StandIn(models=("qwen",))
    kv = {"enabled": policy == "kvcache_aware", "tokenizer": "builtin"}
    with _fleet({"mixed": [llama, qwen]}, policy=policy, kv=kv) as fleet:
        url = fleet.url
        # in runs of one model, so a rotation over both workers would send half to the wrong one
        statuses = [_complete(url, model).status_code for model in ["llama"] * 10 + ["qwen"] * 10]
    assert statuses == [200] * 20
    assert _models_of(llama) == {"llama": 10} and _models_of(qwen) == {"qwen": 10}


def test_prefill_and_decode_both_come_from_the_models_pool() -> None:
    prefills = [
        StandIn(role="prefill", engine_id="p0", models=("llama",)),
        StandIn(role="prefill", engine_id="p1", models=("qwen",)),
    ]
    decodes = [StandIn(role="decode", models=("llama",)), StandIn(role="decode", models=("qwen",))]
    with _fleet({"prefill": prefills, "decode": decodes}, pd={"protocol": "nixl"}) as fleet:
        url = fleet.url
        statuses = [_complete(url, model).status_code for model in ["llama"] * 4 + ["qwen"] * 4]
    assert statuses == [200] * 8
    for worker, model in zip(prefills + decodes, ["llama", "qwen"] * 2, strict=True):
        assert _models_of(worker) == {model: 4}


def test_a_failover_stays_in_the_models_pool() -> None:
    failing, spare, other = StandIn(models=("llama",), fail_status=503), StandIn(models=("llama",)), StandIn(models=("qwen",))
    with _fleet({"mixed": [failing, spare, other]}, outlier={"consecutive_errors": 100}) as fleet:
        url = fleet.url
        statuses = [_complete(url, "llama").status_code for _ in range(6)]
    assert statuses == [200] * 6  # the failing worker's 503s failed over to the other llama worker
    assert failing.requests and _models_of(spare) == {"llama": 6} and not other.requests


def test_no_healthy_worker_left_in_the_pool_is_a_503_naming_the_model() -> None:
    llama, qwen = StandIn(models=("llama",)), StandIn(models=("qwen",))
    with ExitStack() as stack:
        servers = [stack.enter_context(serve(w)) for w in (llama, qwen)]
        overrides = merge_settings(BASELINE, {"mixed": [s.url for s in servers], "health": {"interval_s": 0.1}})
        gateway = Gateway(load_settings(environ={}, overrides=overrides))
        url = stack.enter_context(serve_gateway(gateway)).url
        servers[1].stop()  # the only qwen worker goes away; its probes say so
        assert wait_for(lambda: not gateway.registry.states["mixed-1"].healthy, 60)
        r = _complete(url, "qwen")
        assert r.status_code == 503 and "`qwen`" in r.json()["error"]["message"], r.text
        assert _complete(url, "llama").status_code == 200  # the other pool is untouched
    assert not qwen.requests


def test_an_unknown_model_is_an_openai_404_and_counts_under_no_model() -> None:
    llama = StandIn(models=("llama",))
    with _fleet({"mixed": [llama]}, model_aliases={"ghost": "nobody-serves-this"}) as fleet:
        url = fleet.url
        for model in ("gpt-9", "ghost"):  # an alias whose served name no worker lists is unknown too
            r = _complete(url, model)
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model" and f"`{model}`" in error["message"]
            assert error["type"] and set(r.json()) == {"error"}
        assert _complete(url, "llama").status_code == 200
        assert scrape(url, "conductor_model_requests_total", model="llama", status="200") == 1
        assert scrape(url, "conductor_model_requests_total") == 1  # the unknown names made no series
        assert "ghost" not in _cards(url)
    assert _models_of(llama) == {"llama": 1}


def test_an_alias_is_routed_and_forwarded_as_the_served_name(caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    caplog.set_level(logging.INFO, logger="conductor.decisions")
    llama, qwen = StandIn(models=("llama-3-8b",)), StandIn(models=("qwen",))
    with _fleet({"mixed": [llama, qwen]}, model_aliases={"chat": "llama-3-8b"}) as fleet:
        url = fleet.url
        statuses = [_complete(url, "chat").status_code for _ in range(4)]
        chat = httpx.post(
            url + "/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]}, timeout=30
        )
        assert scrape(url, "conductor_model_requests_total", model="llama-3-8b", status="200") == 5
    assert statuses == [200] * 4 and chat.status_code == 200
    assert _models_of(llama) == {"llama-3-8b": 5} and not qwen.requests  # the worker never saw "chat"
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "conductor.decisions"]
    assert len(logged) == 5 and {line["model"] for line in logged} == {"llama-3-8b"}


def test_models_listed_in_the_settings_are_the_instances_models(tmp_path: Path) -> None:
    # the second worker's /v1/models says "tiny"; the settings say it serves "qwen", and that holds
    llama, qwen = StandIn(models=("llama",)), StandIn(model="tiny")
    with ExitStack() as stack:
        a, b = stack.enter_context(serve(llama)), stack.enter_context(serve(qwen))
        config = tmp_path / "conductor.yaml"
        config.write_text(
            f"mixed:\n  - {a.url}\n  - url: {b.url}\n    models: [qwen]\npolicy: round_robin\nkv: {{enabled: false}}\n"
        )
        gateway = Gateway(load_settings(config, environ={}))
        assert gateway.registry.states["mixed-1"].models == ("qwen",)  # before any probe
        url = stack.enter_context(serve_gateway(gateway)).url
        statuses = [_complete(url, model).status_code for model in ["qwen"] * 4 + ["llama"] * 4]
        assert _complete(url, "tiny").status_code == 404  # listed by the worker, not among its models
        assert set(_cards(url)) == {"llama", "qwen"}
    assert statuses == [200] * 8
    assert _models_of(qwen) == {"qwen": 4} and _models_of(llama) == {"llama": 4}


def test_an_adapter_goes_only_to_the_workers_that_list_it() -> None:
    with_lora, plain = StandIn(models=("llama",), adapters={"sql-lora": "/loras/sql"}), StandIn(models=("llama",))
    with _fleet({"mixed": [with_lora, plain]}, health={"interval_s": 0.1, "models_refresh_s": 0.1}) as fleet:
        url = fleet.url
        state = fleet.gateway.registry.states["mixed-0"]
        assert state.models == ("llama",) and set(state.adapters) == {"sql-lora"}  # an adapter is no base model
        assert state.adapters["sql-lora"].base == "llama" and state.adapters["sql-lora"].path == "/loras/sql"
        statuses = [_complete(url, "sql-lora").status_code for _ in range(6)]
        statuses += [_complete(url, "llama").status_code for _ in range(4)]
        # an adapter loaded at run time joins the pool once the worker's /v1/models is read again
        assert _complete(url, "late-lora").status_code == 404
        plain.adapters["late-lora"] = "/loras/late"
        assert wait_for(lambda: "late-lora" in _cards(url), 60)
        statuses += [_complete(url, "late-lora").status_code for _ in range(4)]
    assert statuses == [200] * 14
    assert _models_of(with_lora) == {"sql-lora": 6, "llama": 2}
    assert _models_of(plain) == {"llama": 2, "late-lora": 4}


def test_a_failed_refresh_keeps_the_last_lists() -> None:
    worker = StandIn(models=("llama",), adapters={"sql-lora": "/loras/sql"})
    with _fleet({"mixed": [worker]}, health={"interval_s": 0.05, "models_refresh_s": 0.05}) as fleet:
        worker.models_status = 500
        reads = worker.models_reads
        assert wait_for(lambda: worker.models_reads >= reads + 5, 60)  # five failed reads at least
        state = fleet.gateway.registry.states["mixed-0"]
        assert state.models == ("llama",) and set(state.adapters) == {"sql-lora"} and state.healthy
        assert _complete(fleet.url, "sql-lora").status_code == 200
    assert _models_of(worker) == {"sql-lora": 1}


def test_an_instance_added_at_run_time_with_its_models_joins_their_pool() -> None:
    llama, qwen = StandIn(models=("llama",)), StandIn(models=("qwen",), models_status=404)
    admin = {"Authorization": "Bearer adm"}
    with serve(qwen) as extra, _fleet({"mixed": [llama]}, auth={"admin_api_keys": ["adm"]}) as fleet:
        assert _complete(fleet.url, "qwen").status_code == 404  # nobody serves it yet
        added = httpx.post(
            fleet.url + "/admin/instances",
            json={"url": extra.url, "role": "mixed", "models": ["qwen"]},
            headers=admin,
            timeout=30,
        )
        assert added.status_code == 201, added.text
        statuses = [_complete(fleet.url, model).status_code for model in ["qwen"] * 3 + ["llama"] * 3]
    assert statuses == [200] * 6
    assert _models_of(qwen) == {"qwen": 3} and _models_of(llama) == {"llama": 3}


def test_v1_models_lists_models_adapters_and_aliases() -> None:
    a = StandIn(models=("llama",), adapters={"sql-lora": "/loras/sql"})
    b = StandIn(models=("qwen",))
    with _fleet({"mixed": [a, b]}, model_aliases={"chat": "llama", "sql": "sql-lora"}) as fleet:
        url = fleet.url
        body = httpx.get(url + "/v1/models", timeout=30).json()
    assert [card["id"] for card in body["data"]] == ["llama", "qwen", "sql-lora", "chat", "sql"]
    cards = {card["id"]: card for card in body["data"]}
    assert cards["sql-lora"]["parent"] == "llama" and cards["sql-lora"]["root"] == "/loras/sql"
    assert cards["llama"]["root"] == "llama" and cards["llama"]["parent"] is None
    assert cards["chat"]["root"] == "llama" and cards["sql"]["root"] == "sql-lora" and "parent" not in cards["sql"]
    assert all(card["object"] == "model" for card in body["data"])


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"mixed": [{"url": "http://a:8000", "models": []}]}, "mixed.0.models"),
        ({"prefill": [{"url": "http://p:8000", "models": [""]}], "decode": ["http://d:8000"]}, "prefill.0.models"),
        (
            {"mixed": ["http://a:8000"], "models": ["llama"], "model_aliases": {"chat": "gpt-9"}},
            "model_aliases: 'chat' names 'gpt-9'",
        ),
        (
            {"mixed": ["http://a:8000"], "model_aliases": {"a": "b", "b": "llama"}},
            "model_aliases: 'a' names 'b', itself an alias",
        ),
        ({"mixed": ["http://a:8000"], "models": ["llama"], "model_aliases": {"llama": "qwen"}}, "model_aliases: 'llama'"),
    ],
)
def test_configuration_errors_name_the_key(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match="invalid configuration") as caught:
        load_settings(environ={}, overrides=settings)
    assert named in str(caught.value)


def test_aliases_and_instance_models_from_the_environment_and_yaml(tmp_path: Path) -> None:
    env = {
        "CONDUCTOR_MIXED": '[{"url": "http://a:8000", "models": ["llama"]}, "http://b:8000"]',
        "CONDUCTOR_MODEL_ALIASES": '{"chat": "llama"}',
        "CONDUCTOR_MODELS": '["llama", "qwen"]',
    }
    s = load_settings(environ=env)
    assert [spec.models for spec in s.mixed] == [("llama",), None] and dict(s.model_aliases) == {"chat": "llama"}
    config = tmp_path / "c.yaml"
    config.write_text("mixed: [{url: 'http://a:8000', models: [llama]}]\nmodel_aliases: {chat: llama}\n")
    s = load_settings(config, environ={})
    assert s.mixed[0].models == ("llama",) and dict(s.model_aliases) == {"chat": "llama"}
    # an alias to a model only an instance lists is fine with `models` configured too
    s = load_settings(config, environ={}, overrides={"models": ["qwen"]})
    assert s.models == ("qwen",)


def test_a_loadable_adapter_nobody_lists_yet_is_known_and_pooled_with_its_base() -> None:
    """`lora_adapters` the gateway may load (conductor/routing/adapter_loads.py): a request for one
    is routed among the workers serving its base model (any worker when it names none), not 404'd."""
    llama, mistral = StandIn(models=("llama",)), StandIn(models=("mistral",))
    loadable = {"sql-lora": {"path": "/loras/sql", "base": "llama"}, "any-lora": {"path": "/loras/any"}}
    with _fleet({"mixed": [llama, mistral]}, lora_adapters=loadable) as fleet:
        pools = fleet.gateway.registry.pools
        assert {"sql-lora", "any-lora"} <= pools.known
        assert pools.excluded("sql-lora") == {"mixed-1"}
        assert pools.excluded("any-lora") == frozenset()
        assert pools.excluded("llama") == {"mixed-1"} and pools.excluded("mistral") == {"mixed-0"}
