"""The `conductor` command line: defaults in every --help, clean errors for bad flags and for
missing optional packages (the full import error with -v), never a traceback by default."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conductor import cli


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
        ("serve", "(default: round_robin)"),
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
    assert "optional package 'vllm'" in err and "conductor-scheduler[vllm]" in err and "Traceback" not in err
    assert "-v" in err


def test_a_real_import_error_is_shown_with_verbose(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", ("test", cli._delegate("conductor_no_such_module_xyz", "main")))
    assert cli.main(["broken"]) == 2
    quiet = capsys.readouterr().err
    assert "an import failed" in quiet and "conductor_no_such_module_xyz" in quiet and "Traceback" not in quiet
    assert cli.main(["-v", "broken"]) == 2
    loud = capsys.readouterr().err
    assert "Traceback" in loud and "ModuleNotFoundError" in loud
