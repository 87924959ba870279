"""One typed settings object: defaults < YAML < environment < flags, with errors that name the field;
settings grouped by concern (pd:, timeouts:, ...), their old flat keys still read with a warning each."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import warnings

import httpx
import pytest

from conductor.cli import add_serve_args, settings_from_args
from conductor.config.legacy import DeprecatedSettingWarning
from conductor.config.settings import load_settings
from conductor.core.errors import ConfigError, PluginError
from conductor.core.types import Role
from policies.registry import load_policy
from tests.support.servers import free_port, serve
from tests.support.standin import StandIn
from tests.support.waiting import wait_for


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

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedSettingWarning)  # the shipped example names no old key
        s = load_settings(Path(__file__).resolve().parents[3] / "examples" / "conductor.yaml", environ={})
    assert s.pd.protocol == "mooncake" and [p.bootstrap_port for p in s.prefill] == [8998, 8998]
    assert s.kv.enabled and s.kv.index == "redis" and s.policy == "kvcache_aware"
    assert s.prefill[0].kv_events_endpoint == "tcp://*:5557"


def test_instance_flags_merge_with_the_config_file_by_url(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.environ", {})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "pd: {protocol: mooncake}\n"
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
        ("nul-key", ["nul-key"]),  # a plain value: one key, as written
        ("12345", ["12345"]),  # ... made it a number, then refused it
        ("sk-single", ["sk-single"]),
        ('["k1-x", "k 2"]', ["k1-x", "k 2"]),  # several keys: a JSON list
    ],
)
def test_api_keys_from_the_environment_round_trip_exactly(value: str, keys: list[str]) -> None:
    s = load_settings(environ={"CONDUCTOR_AUTH__API_KEYS": value})
    assert [k.get_secret_value() for k in s.auth.api_keys] == keys
    assert s.auth.client_keys() == frozenset(keys)
    # secrets are not printed: each key checked, not the raw value (a JSON list's text never shows)
    assert not [key for key in keys if key in repr(s) or key in str(s.auth)]


def test_a_null_api_key_from_the_environment_is_the_key_null() -> None:
    # a YAML reading turns it into no key at all
    assert load_settings(environ={"CONDUCTOR_AUTH__API_KEYS": "null"}).auth.client_keys() == {"null"}


def test_environment_values_take_the_models_types(tmp_path) -> None:
    s = load_settings(
        environ={
            "CONDUCTOR_SLO__TTFT_S": "2",
            "CONDUCTOR_PREFILL": "http://p:1",
            "CONDUCTOR_DECODE": '["http://d:2", "http://d:3"]',
            "CONDUCTOR_KV__ENABLED": "true",
            "CONDUCTOR_MODELS": "tiny",
            "CONDUCTOR_AUTH__UPSTREAM_API_KEY": "up #1",
        }
    )
    assert s.slo.ttft_s == 2.0 and [p.url for p in s.prefill] == ["http://p:1"]
    assert [d.url for d in s.decode] == ["http://d:2", "http://d:3"] and s.kv.enabled and s.models == ("tiny",)
    assert s.auth.upstream_key() == "up #1"
    with pytest.raises(ConfigError, match="slo"):  # the field is named
        load_settings(environ={"CONDUCTOR_SLO": "{not json"})


def test_secrets_from_files_kubernetes_mounts(tmp_path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("# one key a line\nsk-file-1\n\nsk-file-2 #x\n")
    upstream = tmp_path / "upstream"
    upstream.write_text("sk-up\n")
    s = load_settings(
        environ={
            "CONDUCTOR_AUTH__API_KEYS_FILE": str(keys),
            "CONDUCTOR_AUTH__API_KEYS": "sk-env",
            "CONDUCTOR_AUTH__UPSTREAM_API_KEY_FILE": str(upstream),
        }
    )
    assert s.auth.client_keys() == {"sk-env", "sk-file-1", "sk-file-2 #x"}
    assert s.auth.upstream_key() == "sk-up"
    with pytest.raises(ConfigError, match="cannot read secret file"):
        load_settings(environ={"CONDUCTOR_AUTH__API_KEYS_FILE": str(tmp_path / "missing")}).auth.client_keys()


def test_an_indexer_index_needs_its_url_and_names_the_served_model() -> None:
    from conductor.config.derived import kv_settings

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
    base = {
        "prefill": ["http://127.0.0.1:1"],
        "decode": ["http://127.0.0.1:2"],
        "kv": {"enabled": True},
        "pd": {"peer_pull": "on"},
    }
    assert load_settings(environ={}, overrides=base).pd.peer_pull == "on"
    for change in (
        {"kv": {"enabled": False}},
        {"pd": {"peer_pull": "on", "protocol": "mooncake"}, "prefill": [{"url": "http://127.0.0.1:1", "bootstrap_port": 3}]},
        {"decode": []},
    ):
        with pytest.raises(ConfigError, match=r"pd\.peer_pull"):
            load_settings(environ={}, overrides={**base, **change})


OLD_FLAT_YAML = """
pd_protocol: nixl
pd_readback_ttl_s: 90
health_interval_s: 0.25
load_share: redis
load_share_timeout_s: 0.7
api_keys: [sk-old]
read_timeout_s: 33
log_level: warning
mixed: ['http://m:1']
"""


def _moved(caught: list[warnings.WarningMessage]) -> list[str]:
    """The messages of the deprecation warnings caught, in order."""
    return [str(w.message) for w in caught if issubclass(w.category, DeprecatedSettingWarning)]


def test_an_old_flat_yaml_still_builds_with_one_warning_per_key(tmp_path) -> None:
    cfg = tmp_path / "old.yaml"
    cfg.write_text(OLD_FLAT_YAML)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = load_settings(cfg, environ={})
    assert (s.pd.protocol, s.pd.readback_ttl_s, s.health.interval_s, s.timeouts.read_s) == ("nixl", 90, 0.25, 33)
    assert (s.load_share.mode, s.load_share.timeout_s, s.logs.level) == ("redis", 0.7, "warning")
    assert s.auth.client_keys() == {"sk-old"}
    moved = _moved(caught)
    assert len(moved) == 8  # one per old key, none twice
    assert any(m.startswith("setting 'pd_readback_ttl_s' is deprecated: use 'pd.readback_ttl_s'") for m in moved)
    assert any("'load_share' is deprecated: use 'load_share.mode'" in m for m in moved)
    assert any("'read_timeout_s' is deprecated: use 'timeouts.read_s'" in m and "CONDUCTOR_TIMEOUTS__READ_S" in m for m in moved)
    assert issubclass(DeprecatedSettingWarning, FutureWarning)  # shown to operators by default


def test_an_old_environment_variable_still_works_and_names_the_new_one() -> None:
    environ = {
        "CONDUCTOR_HEALTH_INTERVAL_S": "0.5",
        "CONDUCTOR_LOAD_SHARE": "redis",  # the old key is a mode; the group itself is a JSON object
        "CONDUCTOR_API_KEYS": "sk-a #b",  # still one key exactly as written
        "CONDUCTOR_PD_PEER_PULL_PRIORITY": "-1",
        "CONDUCTOR_MIXED": "http://m:1",
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = load_settings(environ=environ)
    assert (s.health.interval_s, s.load_share.mode, s.pd.peer_pull_priority) == (0.5, "redis", -1)
    assert s.auth.client_keys() == {"sk-a #b"}
    moved = _moved(caught)
    assert len(moved) == 4
    assert any(
        "'health_interval_s' is deprecated: use 'health.interval_s'" in m
        and "CONDUCTOR_HEALTH__INTERVAL_S instead of CONDUCTOR_HEALTH_INTERVAL_S" in m
        for m in moved
    )
    # the new group as a JSON object is not mistaken for the old key
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedSettingWarning)
        assert load_settings(environ={"CONDUCTOR_LOAD_SHARE": '{"mode": "redis"}'}).load_share.mode == "redis"


def test_old_and_new_key_in_one_source_is_an_error(tmp_path) -> None:
    cfg = tmp_path / "both.yaml"
    cfg.write_text("pd_readback_ttl_s: 90\npd: {readback_ttl_s: 60}\n")
    with pytest.raises(ConfigError, match=r"both 'pd_readback_ttl_s' \(deprecated\) and 'pd.readback_ttl_s'"):
        load_settings(cfg, environ={})
    with pytest.raises(ConfigError, match=r"environment.*'health_interval_s'.*'health.interval_s'"):
        load_settings(environ={"CONDUCTOR_HEALTH_INTERVAL_S": "1", "CONDUCTOR_HEALTH__INTERVAL_S": "2"})
    with pytest.raises(ConfigError, match=r"overrides.*'load_share_timeout_s'.*'load_share.timeout_s'"):
        load_settings(environ={}, overrides={"load_share": {"timeout_s": 2.0}, "load_share_timeout_s": 1.0})
    # across sources the usual precedence holds: an old variable still overrides the file's new key
    cfg.write_text("pd: {readback_ttl_s: 60}\n")
    with pytest.warns(DeprecatedSettingWarning, match="pd.readback_ttl_s"):
        assert load_settings(cfg, environ={"CONDUCTOR_PD_READBACK_TTL_S": "45"}).pd.readback_ttl_s == 45


def test_every_old_key_moves_to_a_real_field() -> None:
    from conductor.config.legacy import MOVED
    from conductor.config.settings import Settings

    for old, new in MOVED.items():
        group, _, key = new.partition(".")
        group_model = Settings.model_fields[group].annotation
        assert key in group_model.model_fields, new  # type: ignore[union-attr]
        assert old not in Settings.model_fields or old == group  # the old name is gone from the top level
    # and a keyword of Settings(...) moves as a YAML key does
    with pytest.warns(DeprecatedSettingWarning, match="'outlier.ejection_s'"):
        assert Settings(outlier_ejection_s=12.0).outlier.ejection_s == 12.0


def test_serve_flags_keep_their_names_and_set_the_grouped_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.environ", {})
    argv = ["--mixed", "http://m:1", "--pd-protocol", "sglang", "--mooncake-schema", "engine_id", "--api-key", "sk-1"]
    argv += ["--upstream-api-key", "up", "--max-body-bytes", "1234", "--log-level", "debug", "--slo-tbt", "0.2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedSettingWarning)
        s = settings_from_args(_args(argv))
    assert (s.pd.protocol, s.pd.mooncake_schema, s.limits.max_body_bytes, s.logs.level) == ("sglang", "engine_id", 1234, "debug")
    assert s.auth.client_keys() == {"sk-1"} and s.auth.upstream_key() == "up" and s.slo.tbt_s == 0.2
    # flags left out set nothing: the defaults (or the file) stay
    s = settings_from_args(_args(["--mixed", "http://m:1"]))
    assert s.pd.protocol == "nixl" and s.limits.max_body_bytes == 16 * 1024 * 1024 and s.slo.tbt_s is None


def test_conductor_serve_starts_from_an_old_flat_yaml_and_says_what_to_rename(tmp_path) -> None:
    port = free_port()
    with serve(StandIn(role="mixed", model="tiny")) as worker:
        cfg = tmp_path / "old.yaml"
        cfg.write_text(
            f"port: {port}\nmixed: ['{worker.url}']\nmodels: [tiny]\n"
            "health_interval_s: 0.2\nrequest_timeout_s: 30\ndrain_grace_s: 1\nlog_level: warning\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "conductor", "serve", "--config", str(cfg)],
            env={"PATH": "/usr/bin:/bin"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            assert wait_for(lambda: proc.poll() is not None or _answers(url + "/health"), timeout=60), "no /health"
            assert proc.poll() is None, "the gateway exited"
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    for old, new in (("health_interval_s", "health.interval_s"), ("request_timeout_s", "timeouts.request_s")):
        assert f"setting '{old}' is deprecated: use '{new}'" in err, err
    assert err.count("is deprecated") == 4 and "Traceback" not in err  # one warning a key


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_building_settings_loads_no_io_library() -> None:
    # the settings moved out of conductor/kv/analyzer.py so that config/ needs pydantic, yaml and core only
    probe = "import sys, conductor.config.settings; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    assert not [lib for lib in ("'adapters'", "'zmq'", "'httpx'", "'redis'", "'uvicorn'") if lib in loaded], loaded


def test_prompts_go_on_as_ids_only_with_a_tokenizer_known_to_be_the_models() -> None:
    from conductor.config.derived import kv_settings

    def forwards(kv: dict[str, object]) -> bool:
        return kv_settings(load_settings(environ={}, overrides={"mixed": ["http://m:1"], "kv": kv})).forward_token_ids

    # auto may end on the byte tokenizer (a worker without /tokenize), whose ids mean nothing to a model
    assert not forwards({}) and not forwards({"tokenizer": "builtin"})
    assert forwards({"tokenizer": "worker"}) and forwards({"tokenizer": "auto", "forward_token_ids": True})


def test_an_unknown_vllm_hash_algorithm_is_a_config_error_not_a_start_up_traceback() -> None:
    with pytest.raises(ConfigError, match=r"kv\.vllm_hash_algo must be one of sha256, sha256_cbor, xxhash, xxhash_cbor"):
        load_settings(environ={}, overrides={"mixed": ["http://m:1"], "kv": {"key_mode": "vllm", "vllm_hash_algo": "md5"}})
    # in xxhash mode the workers' algorithm is not used: left as it was
    assert load_settings(environ={}, overrides={"mixed": ["http://m:1"], "kv": {"vllm_hash_algo": "md5"}}).kv.key_mode == "xxhash"
