"""The `pools:` section (conductor/config/pools.py): each model's instances folded into the top-level
lists with their model and a readable name, every bad pool a start-up error naming `pools.<model>`, the
YAML, environment and flag forms, and a pool's SLO used by admission for its model's requests (real
sockets, stand-in workers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from conductor.config.settings import Settings, load_settings, merge_settings
from conductor.core.errors import ConfigError
from conductor.core.types import Role
from conductor.gateway import Gateway
from tests.support.servers import serve, serve_gateway
from tests.support.standin import StandIn

pytestmark = pytest.mark.timeout(300)

TWO_MODELS = """
mixed: [http://plain-0:8000]
models: [llama]
pools:
  llama:
    mixed:
      - http://llama-0:8000
      - {url: http://llama-1:8000, name: big-llama, kv_events_endpoint: "tcp://*:5557"}
  meta/Qwen3 8B:
    prefill: [http://qwen-p0:8000]
    decode: [http://qwen-d0:8000, http://qwen-d1:8000]
    slo: {ttft_s: 2.0}
slo: {ttft_s: 9.0, tbt_s: 0.1}
"""


def _load(**given: Any) -> Settings:
    return load_settings(environ={}, overrides=given)


def test_pools_are_folded_into_the_instance_lists_with_their_model_and_a_name(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TWO_MODELS)
    s = load_settings(cfg, environ={})
    got = [(spec.name, spec.role, spec.url, spec.models) for spec in s.instances()]
    assert got == [
        ("meta-Qwen3-8B-prefill-0", Role.PREFILL, "http://qwen-p0:8000", ("meta/Qwen3 8B",)),
        ("meta-Qwen3-8B-decode-0", Role.DECODE, "http://qwen-d0:8000", ("meta/Qwen3 8B",)),
        ("meta-Qwen3-8B-decode-1", Role.DECODE, "http://qwen-d1:8000", ("meta/Qwen3 8B",)),
        ("mixed-0", Role.MIXED, "http://plain-0:8000", None),  # a top-level instance keeps today's name
        ("llama-mixed-0", Role.MIXED, "http://llama-0:8000", ("llama",)),
        ("big-llama", Role.MIXED, "http://llama-1:8000", ("llama",)),
    ]
    assert s.mixed[2].kv_events_endpoint == "tcp://*:5557"  # every instance field as in the top-level lists
    assert s.models == ("llama", "meta/Qwen3 8B")  # a configured `models` gets each pool's model
    assert s.pools["llama"].mixed == s.mixed[1:] and s.pools["llama"].slo is None
    assert s.disaggregated


def test_without_pools_nothing_changes() -> None:
    s = _load(mixed=["http://a:1", "http://b:1"], models=["m"])
    assert [spec.name for spec in s.instances()] == ["mixed-0", "mixed-1"]
    assert s.pools == {} and s.models == ("m",) and all(spec.models is None for spec in s.instances())
    assert _load(pools={"m": {"mixed": ["http://a:1"]}}).models == ()  # no `models`: still learned from the workers


def test_the_environment_and_flags_give_pools_too(tmp_path: Path) -> None:
    env = {"CONDUCTOR_POOLS": json.dumps({"qwen": {"mixed": ["http://q:1"], "slo": {"ttft_s": 0.5}}})}
    s = load_settings(environ=env)
    assert [(spec.name, spec.models) for spec in s.instances()] == [("qwen-mixed-0", ("qwen",))]
    assert s.pools["qwen"].slo is not None and s.pools["qwen"].slo.ttft_s == 0.5
    # the environment's pool merges into the file's key by key: its SLO beside the file's instances
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pools: {qwen: {mixed: [http://q:1]}}\n")
    s = load_settings(
        cfg, environ={"CONDUCTOR_POOLS": '{"qwen": {"slo": {"tbt_s": 0.05}}}'}, overrides={"mixed": ["http://top:1"]}
    )
    assert [spec.name for spec in s.instances()] == ["mixed-0", "qwen-mixed-0"]
    assert s.pools["qwen"].slo is not None and s.pools["qwen"].slo.tbt_s == 0.05


@pytest.mark.parametrize(
    ("pools", "extra", "words"),
    [
        ({"qwen": {}}, {}, ["pools.qwen", "no instances"]),
        ({"qwen": None}, {}, ["pools.qwen", "no instances"]),
        ({"qwen": {"slo": {"ttft_s": 1}}}, {}, ["pools.qwen", "no instances"]),
        ({"qwen": {"prefill": ["http://p:1"]}}, {}, ["pools.qwen", "prefill instances without decode"]),
        ({"qwen": {"decode": ["http://d:1"]}}, {}, ["pools.qwen", "decode instances without prefill"]),
        (
            {"qwen": {"mixed": ["http://m:1"], "prefill": ["http://p:1"], "decode": ["http://d:1"]}},
            {},
            ["pools.qwen", "mixed instances beside prefill/decode"],
        ),
        ({"qwen": {"mixed": [{"url": "http://m:1", "models": ["llama"]}]}}, {}, ["pools.qwen", "without 'qwen'"]),
        ({"qwen": {"mixed": [{"url": "http://m:1", "role": "decode"}]}}, {}, ["pools.qwen", "listed under mixed"]),
        ({"qwen": {"mixed": ["ftp://m:1"]}}, {}, ["pools.qwen.mixed.0.url", "http://"]),
        ({"qwen": {"mixed": ["http://m:1"], "policy": "x"}}, {}, ["pools.qwen.policy", "not permitted"]),
        ({"qwen": ["http://m:1"]}, {}, ["pools.qwen", "must be a mapping"]),
        ({"chat": {"mixed": ["http://m:1"]}}, {"model_aliases": {"chat": "llama"}}, ["pools.chat", "alias"]),
        ({"": {"mixed": ["http://m:1"]}}, {}, ["pools", "non-empty"]),
        # names stay unique: a pool instance named as a top-level one is the usual error
        ({"q": {"mixed": [{"url": "http://m:1", "name": "mixed-0"}]}}, {"mixed": ["http://a:1"]}, ["unique", "mixed-0"]),
    ],
)
def test_a_bad_pool_is_a_start_up_error_naming_it(pools: dict[str, Any], extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _load(pools=pools, **extra)
    for word in words:
        assert word in err.value.message, err.value.message


def test_a_bad_pool_in_yaml_and_in_the_environment_names_it(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pools:\n  qwen:\n    prefill: [http://p:1]\n")
    with pytest.raises(ConfigError, match=r"pools\.qwen: prefill instances without decode"):
        load_settings(cfg, environ={})
    with pytest.raises(ConfigError, match=r"pools\.llama: no instances"):
        load_settings(environ={"CONDUCTOR_POOLS": '{"llama": {}}'})


# ---- a pool's SLO, as the router and admission use it ------------------------------------------

BASELINE = {"policy": "kvcache_aware", "kv": {"enabled": False, "tokenizer": "builtin"}, "health": {"interval_s": 0.5}}


@contextmanager
def _gateway(pools: dict[str, list[StandIn]], slos: dict[str, dict[str, float]], **settings: Any) -> Iterator[str]:
    """Stand-in mixed workers served, one pool per model, and a gateway in front of them."""
    with ExitStack() as stack:
        given: dict[str, Any] = {}
        for model, workers in pools.items():
            given[model] = {"mixed": [stack.enter_context(serve(w)).url for w in workers]}
            if model in slos:
                given[model]["slo"] = slos[model]
        gateway = Gateway(load_settings(environ={}, overrides=merge_settings(BASELINE, {"pools": given, **settings})))
        yield stack.enter_context(serve_gateway(gateway)).url


def _complete(url: str, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": model, "prompt": "x" * 4000, "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)


def test_a_pools_slo_is_what_admission_holds_its_requests_to() -> None:
    llama, qwen = StandIn(models=("llama",)), StandIn(models=("qwen",))
    # gateway-wide: generous; qwen's pool: a TTFT no prefill of 1,000 tokens meets
    slos = {"qwen": {"ttft_s": 0.0001}}
    with _gateway({"llama": [llama], "qwen": [qwen]}, slos, slo={"ttft_s": 60.0}, model_aliases={"fast": "qwen"}) as url:
        for model in ("qwen", "fast"):  # an alias's requests are held to its served model's SLO
            rejected = _complete(url, model)
            assert rejected.status_code == 429, rejected.text
            assert rejected.json()["error"]["code"] == "ttft_slo"
        assert _complete(url, "llama").status_code == 200
        # a per-request header still overrides the pool's SLO
        assert _complete(url, "qwen", {"x-slo-ttft-ms": "60000"}).status_code == 200
    assert len(qwen.requests) == 1 and len(llama.requests) == 1


def test_a_pools_slo_overrides_the_gateway_wide_one_field_by_field() -> None:
    llama, qwen = StandIn(models=("llama",)), StandIn(models=("qwen",))
    # the gateway-wide TTFT is the tight one; qwen's pool sets a TBT only, so keeps that TTFT,
    # and llama's pool says it has no TTFT SLO at all (null)
    slos: dict[str, Any] = {"qwen": {"tbt_s": 5.0}, "llama": {"ttft_s": None}}
    with _gateway({"llama": [llama], "qwen": [qwen]}, slos, slo={"ttft_s": 0.0001}) as url:
        assert _complete(url, "qwen").status_code == 429
        assert _complete(url, "llama").status_code == 200


def test_a_mixed_pool_beside_a_pd_pool_serves_both_models() -> None:
    llama = StandIn(models=("llama",))
    prefill, decode = StandIn(role="prefill", models=("qwen",)), StandIn(role="decode", models=("qwen",))
    with ExitStack() as stack:
        llama_url, prefill_url, decode_url = (stack.enter_context(serve(w)).url for w in (llama, prefill, decode))
        pools = {"llama": {"mixed": [llama_url]}, "qwen": {"prefill": [prefill_url], "decode": [decode_url]}}
        given = merge_settings(BASELINE, {"pools": pools, "pd": {"protocol": "nixl"}})
        url = stack.enter_context(serve_gateway(Gateway(load_settings(environ={}, overrides=given)))).url
        statuses = [_complete(url, model).status_code for model in ("qwen", "llama", "qwen", "llama")]
    assert statuses == [200] * 4
    assert len(llama.requests) == 2 and len(prefill.requests) == len(decode.requests) == 2


def _yaml_blocks(doc: str) -> list[str]:
    """The ```yaml blocks of `doc` (README.md, docs/...) that configure pools, unindented."""
    import textwrap

    text = (Path(__file__).resolve().parents[3] / doc).read_text()
    blocks = [part.split("```", 1)[0] for part in text.split("```yaml\n")[1:]]
    return [textwrap.dedent(block) for block in blocks if "pools:" in block]


@pytest.mark.parametrize("doc", ["README.md", "docs/deploy.md"])
def test_the_documented_two_model_configurations_are_valid(doc: str, tmp_path: Path) -> None:
    (block,) = _yaml_blocks(doc)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(block)
    s = load_settings(cfg, environ={})
    assert set(s.pools) == {"meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-8B"}
    assert [spec.name for spec in s.instances()] == [
        "Qwen-Qwen3-8B-prefill-0",
        "Qwen-Qwen3-8B-decode-0",
        "meta-llama-Llama-3.1-8B-Instruct-mixed-0",
        "meta-llama-Llama-3.1-8B-Instruct-mixed-1",
    ]
