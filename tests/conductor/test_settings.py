"""One typed settings object: defaults < YAML < environment < flags, with errors that name the field."""

from __future__ import annotations

import argparse

import pytest

from conductor.cli import add_serve_args, settings_from_args
from conductor.config.settings import load_settings
from conductor.core.errors import ConfigError, PluginError
from conductor.core.types import Role
from policies.registry import load_policy


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_router_style_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.environ", {})
    s = settings_from_args(
        _args(
            [
                "--prefill",
                "http://p0:8100",
                "8998",
                "--prefill",
                "http://p1:8100",
                "none",
                "--decode",
                "http://d0:8200",
                "--decode",
                "http://d1:8200/",
                "--pd-protocol",
                "nixl",
            ]
        )
    )
    assert [(i.name, i.url, i.bootstrap_port) for i in s.instances()] == [
        ("prefill-0", "http://p0:8100", 8998),
        ("prefill-1", "http://p1:8100", None),
        ("decode-0", "http://d0:8200", None),
        ("decode-1", "http://d1:8200", None),
    ]
    # mooncake needs every prefill's bootstrap port: that is checked here, not per request
    with pytest.raises(ConfigError, match="bootstrap port"):
        settings_from_args(_args(["--prefill", "http://p1:8100", "--decode", "http://d0:8200", "--pd-protocol", "mooncake"]))


def test_precedence_yaml_env_flags(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "port: 9000\npolicy: round_robin\nslo: {ttft_s: 5, tbt_s: 0.2}\n"
        "prefill: [{url: 'http://p:1', bootstrap_port: 7}]\ndecode: ['http://d:2']\n"
    )
    s = load_settings(cfg, environ={"CONDUCTOR_PORT": "9100", "CONDUCTOR_SLO__TBT_S": "0.1"}, overrides={"port": 9200})
    assert s.port == 9200  # flag beats env beats file
    assert s.slo.ttft_s == 5 and s.slo.tbt_s == 0.1  # env overrides one nested field, the file the other
    assert s.prefill[0].bootstrap_port == 7 and s.decode[0].role is Role.DECODE


def test_errors_name_the_field(tmp_path) -> None:
    with pytest.raises(ConfigError, match="port"):
        load_settings(environ={"CONDUCTOR_PORT": "not-a-port"})
    with pytest.raises(ConfigError, match="http"):
        load_settings(environ={}, overrides={"decode": ["ftp://x"]})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("nonsense_field: 1\n")
    with pytest.raises(ConfigError, match="nonsense_field"):
        load_settings(bad, environ={})


def test_unknown_policy_fails_loudly() -> None:
    with pytest.raises(PluginError, match="not registered"):
        load_policy("no_such_policy")


def test_settings_are_frozen() -> None:
    s = load_settings(environ={})
    with pytest.raises(Exception):
        s.port = 1  # type: ignore[misc]


def test_example_config_is_valid() -> None:
    from pathlib import Path

    s = load_settings(Path(__file__).resolve().parents[2] / "examples" / "conductor.yaml", environ={})
    assert s.pd_protocol == "mooncake" and [p.bootstrap_port for p in s.prefill] == [8998, 8998]
    assert s.kv.enabled and s.kv.index == "redis" and s.policy == "kvcache_aware"
    assert s.prefill[0].kv_events_endpoint == "tcp://*:5557"


def test_instance_flags_merge_with_the_config_file_by_url(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.environ", {})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "pd_protocol: mooncake\n"
        "prefill:\n"
        "  - {url: 'http://p0:8100', name: p-a, bootstrap_port: 8998, kv_events_endpoint: 'tcp://*:5557'}\n"
        "  - {url: 'http://p1:8100', bootstrap_port: 8998, kv_events_endpoint: 'tcp://*:5558'}\n"
        "decode: [{url: 'http://d0:8200', name: d-a}]\n"
        "mixed: [{url: 'http://m0:8300', kv_events_endpoint: 'tcp://*:5559'}]\n"
    )
    s = settings_from_args(
        _args(
            [
                "--config",
                str(cfg),
                "--prefill",
                "http://p0:8100/",  # known URL (a trailing slash is the same URL): keeps name, port, events
                "--prefill",
                "http://p1:8100",
                "9000",  # known URL with a port: the port changes, the events stay
                "--prefill",
                "http://p2:8100",
                "8998",  # a new one: added
                "--decode",
                "http://d1:8200",
                "--mixed",
                "http://m0:8300",
            ]
        )
    )
    assert [(p.name, p.url, p.bootstrap_port, p.kv_events_endpoint) for p in s.prefill] == [
        ("p-a", "http://p0:8100", 8998, "tcp://*:5557"),
        (None, "http://p1:8100", 9000, "tcp://*:5558"),
        (None, "http://p2:8100", 8998, None),
    ]
    assert [(i.name, i.url) for i in s.instances() if i.role is Role.DECODE] == [
        ("d-a", "http://d0:8200"),
        ("decode-1", "http://d1:8200"),
    ]
    assert s.mixed[0].kv_events_endpoint == "tcp://*:5559"
    # an explicit "none" clears the file's bootstrap port (nixl needs none)
    s = settings_from_args(_args(["--config", str(cfg), "--prefill", "http://p0:8100", "none", "--pd-protocol", "nixl"]))
    assert s.prefill[0].bootstrap_port is None and s.prefill[0].kv_events_endpoint == "tcp://*:5557"


def test_vllm_hash_seed_may_be_written_as_a_number(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kv: {enabled: true, key_mode: vllm, vllm_hash_seed: 123}\n")
    assert load_settings(cfg, environ={}).kv.vllm_hash_seed == "123"
    assert load_settings(environ={"CONDUCTOR_KV__VLLM_HASH_SEED": "0"}).kv.vllm_hash_seed == "0"
    assert load_settings(environ={}).kv.vllm_hash_seed is None  # never the gateway's own PYTHONHASHSEED


@pytest.mark.parametrize(
    ("value", "keys"),
    [
        ("sk-a #b", ["sk-a #b"]),  # a YAML reading cut the "comment"
        ("null", ["null"]),  # ... turned it into no key at all
        ("12345", ["12345"]),  # ... made it a number, then refused it
        ("sk-single", ["sk-single"]),
        ('["k1", "k 2"]', ["k1", "k 2"]),  # several keys: a JSON list
    ],
)
def test_api_keys_from_the_environment_round_trip_exactly(value: str, keys: list[str]) -> None:
    s = load_settings(environ={"CONDUCTOR_API_KEYS": value})
    assert [k.get_secret_value() for k in s.api_keys] == keys
    assert s.client_keys() == frozenset(keys)
    assert value not in repr(s) or value == "null"  # secrets are not printed


def test_environment_values_take_the_models_types(tmp_path) -> None:
    s = load_settings(
        environ={
            "CONDUCTOR_SLO__TTFT_S": "2",
            "CONDUCTOR_PREFILL": "http://p:1",
            "CONDUCTOR_DECODE": '["http://d:2", "http://d:3"]',
            "CONDUCTOR_KV__ENABLED": "true",
            "CONDUCTOR_MODELS": "tiny",
            "CONDUCTOR_UPSTREAM_API_KEY": "up #1",
        }
    )
    assert s.slo.ttft_s == 2.0 and [p.url for p in s.prefill] == ["http://p:1"]
    assert [d.url for d in s.decode] == ["http://d:2", "http://d:3"] and s.kv.enabled and s.models == ("tiny",)
    assert s.upstream_key() == "up #1"
    with pytest.raises(ConfigError, match="slo"):  # the field is named
        load_settings(environ={"CONDUCTOR_SLO": "{not json"})


def test_secrets_from_files_kubernetes_mounts(tmp_path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("# one key a line\nsk-file-1\n\nsk-file-2 #x\n")
    upstream = tmp_path / "upstream"
    upstream.write_text("sk-up\n")
    s = load_settings(
        environ={
            "CONDUCTOR_API_KEYS_FILE": str(keys),
            "CONDUCTOR_API_KEYS": "sk-env",
            "CONDUCTOR_UPSTREAM_API_KEY_FILE": str(upstream),
        }
    )
    assert s.client_keys() == {"sk-env", "sk-file-1", "sk-file-2 #x"}
    assert s.upstream_key() == "sk-up"
    with pytest.raises(ConfigError, match="cannot read secret file"):
        load_settings(environ={"CONDUCTOR_API_KEYS_FILE": str(tmp_path / "missing")}).client_keys()


def test_an_indexer_index_needs_its_url_and_names_the_served_model() -> None:
    from conductor.gateway import kv_settings

    with pytest.raises(ConfigError, match=r"kv\.indexer_url"):
        load_settings(environ={}, overrides={"mixed": ["http://m:1"], "kv": {"enabled": True, "index": "indexer"}})
    s = load_settings(
        environ={},
        overrides={
            "mixed": ["http://m:1"],
            "models": ["qwen"],
            "kv": {"enabled": True, "index": "indexer", "indexer_url": "http://indexer:8400"},
        },
    )
    assert kv_settings(s).indexer_model == "qwen"


def test_peer_pull_on_needs_nixl_decodes_and_kv_awareness() -> None:
    base = {"prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:2"], "kv": {"enabled": True}, "pd_peer_pull": "on"}
    assert load_settings(environ={}, overrides=base).pd_peer_pull == "on"
    for change in (
        {"kv": {"enabled": False}},
        {"pd_protocol": "mooncake", "prefill": [{"url": "http://127.0.0.1:1", "bootstrap_port": 3}]},
        {"decode": []},
    ):
        with pytest.raises(ConfigError, match="pd_peer_pull"):
            load_settings(environ={}, overrides={**base, **change})
