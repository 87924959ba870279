"""The `conductor` command line: defaults in every --help, clean errors for bad flags and for
missing optional packages (the full import error with -v), never a traceback by default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conductor import cli
from conductor.config.derived import kv_settings
from conductor.config.settings import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conductor", *args], capture_output=True, text=True, timeout=60)


def test_bad_bootstrap_port_is_a_clean_error() -> None:
    r = run("serve", "--prefill", "http://127.0.0.1:1", "abc", "--decode", "http://127.0.0.1:2")
    assert r.returncode == 2
    assert "bootstrap port must be a number" in r.stderr and "'abc'" in r.stderr
    assert "Traceback" not in r.stderr


def test_no_instances_is_a_clean_error() -> None:
    r = run("serve")
    assert r.returncode == 2 and "no instances" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("serve", "(default: kvcache_aware)"),
        ("replay", "(default: round_robin)"),
        ("tune-pd", "(default: round_robin)"),
        ("demo", "(default: kvcache_aware)"),
        ("emulate", "(default: 127.0.0.1)"),
        ("fit", "(default: "),
    ],
)
def test_every_help_shows_defaults(command: str, shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    assert shown in " ".join(capsys.readouterr().out.split())


def test_serve_help_shows_the_defaults_of_grouped_settings(capsys: pytest.CaptureFixture[str]) -> None:
    # --pd-protocol sets pd.protocol, --max-body-bytes limits.max_body_bytes, --log-level logs.level
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for text in ("P/D handshake (default: nixl)", "(default: transfer_id)", "largest request body (default: 16777216)"):
        assert text in shown
    assert "(default: info)" in shown


def test_missing_optional_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "needs-vllm", ("test", cli._delegate("vllm.not_here", "main")))
    assert cli.main(["needs-vllm"]) == 2
    err = capsys.readouterr().err
    assert "optional package 'vllm'" in err and "pip install '.[vllm]'" in err and "Traceback" not in err
    assert "-v" in err


def test_a_real_import_error_is_shown_with_verbose(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", ("test", cli._delegate("conductor_no_such_module_xyz", "main")))
    assert cli.main(["broken"]) == 2
    quiet = capsys.readouterr().err
    assert "an import failed" in quiet and "conductor_no_such_module_xyz" in quiet and "Traceback" not in quiet
    assert cli.main(["-v", "broken"]) == 2
    loud = capsys.readouterr().err
    assert "Traceback" in loud and "ModuleNotFoundError" in loud


def test_serve_help_points_to_the_example_config_and_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "examples/conductor.yaml" in shown and "conductor serve --print-example-config > conductor.yaml" in shown
    assert "--check" in shown and "--probe" in shown
    assert "--kv-index {memory,redis,redis_cluster,indexer}" in shown and "--kv, --no-kv" in shown


def test_the_shipped_example_config_is_the_repositorys_and_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--print-example-config"]) == 0
    printed = capsys.readouterr().out
    assert printed == (REPO / "examples" / "conductor.yaml").read_text(encoding="utf-8")  # one file, two places
    settings = load_settings(REPO / "examples" / "conductor.yaml", environ={})
    assert settings.policy == "kvcache_aware" and len(settings.prefill) == 2


def _serve_settings(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    settings: Settings = cli.settings_from_args(parser.parse_args(["--mixed", "http://m:1", *argv]))
    return settings


def test_the_kv_flags_set_the_kv_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.upper().startswith("CONDUCTOR_")]:
        monkeypatch.delenv(name)
    assert not _serve_settings("--no-kv").kv.enabled and _serve_settings("--kv").kv.enabled
    worker = _serve_settings("--tokenizer", "http://tok:8000").kv
    assert worker.tokenizer == "worker" and worker.tokenizer_url == "http://tok:8000"
    assert _serve_settings("--tokenizer", "/models/qwen").kv.tokenizer == "/models/qwen"
    s = _serve_settings("--block-size", "32", "--kv-index", "redis", "--redis-url", "redis://r:6379/1")
    assert s.block_size == 32 and kv_settings(s).block_size == 32  # the one block size, the index's too
    assert s.kv.index == "redis" and s.kv.redis_url == "redis://r:6379/1" and s.load_share.redis_url != "redis://r:6379/1"
    s = _serve_settings("--key-mode", "vllm", "--hash-algo", "xxhash", "--hash-seed", "123")
    assert (s.kv.key_mode, s.kv.vllm_hash_algo, s.kv.vllm_hash_seed) == ("vllm", "xxhash", "123")
    s = _serve_settings("--kv-index", "indexer", "--indexer-url", "http://indexer:8400")
    assert s.kv.index == "indexer" and s.kv.indexer_url == "http://indexer:8400"
    with pytest.raises(SystemExit):  # the choices are the settings' own
        _serve_settings("--kv-index", "sqlite")
