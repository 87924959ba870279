"""`conductor serve --check [--probe]`: the configuration checked without starting anything (exit 0
with a summary, 2 with the one-line error), and with --probe every worker reached over HTTP, one line
per instance (exit 1 naming the one that failed). Workers are emulated vLLM processes and stand-ins
on real sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from conductor import cli
from tests.support.emulator import Emulator, start_emulator
from tests.support.ports import free_port
from tests.support.servers import serve
from tests.support.standin import StandIn

CHECK = "conductor serve --check"


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of `conductor serve ... --check`, run in this process."""
    code = cli.main(["serve", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def _line(lines: list[str], name: str) -> str:
    (found,) = [line for line in lines if line.startswith(f"{name} (")]
    return found


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Emulator, Emulator]]:
    """An emulated prefill publishing KV events and a decode: what --probe is for."""
    with ExitStack() as stack:
        p = stack.enter_context(
            start_emulator("prefill", "nixl", kv_events=True, bootstrap=False, model="tiny", max_model_len=4096)
        )
        d = stack.enter_context(start_emulator("decode", "nixl", model="tiny", max_model_len=4096))
        yield p, d


def _config(tmp_path: Path, settings: dict[str, object]) -> str:
    path = tmp_path / "conductor.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def _events_config(tmp_path: Path, p: Emulator, d: Emulator, **extra: object) -> str:
    # the emulator binds its PUB on every address ("tcp://*:PORT", as vLLM's --kv-events-config says)
    assert p.kv_events_endpoint is not None
    port = p.kv_events_endpoint.rpartition(":")[2]
    prefill = {"url": p.url, "kv_events_endpoint": f"tcp://*:{port}"}
    return _config(tmp_path, {"prefill": [prefill], "decode": [d.url], **extra})


def test_a_good_config_passes_with_a_one_line_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _check(capsys, "--prefill", "http://p:8000", "--decode", "http://d:8000", "--check")
    assert code == 0, err
    (summary,) = out  # nothing is reached without --probe: these hosts do not exist
    assert summary.startswith(f"{CHECK}: configuration ok: 1 prefill, 1 decode, 0 mixed")
    assert "policy kvcache_aware" in summary and "KV index memory" in summary and "tokenizer auto" in summary
    assert "KV events from 0 of 1 prefill/mixed instances (the gateway's own dispatch records for the rest)" in summary


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"mixed": ["http://m:1"], "kv": {"index": "indexer"}}, "kv.indexer_url"),
        ({"mixed": ["http://m:1"], "policy": "no_such_policy"}, "policy 'no_such_policy' is not registered"),
        ({"mixed": ["http://m:1"], "policy_options": {"ttft_slack": "lots"}}, "'ttft_slack'"),
        ({"mixed": ["http://m:1"], "kv": {"key_mode": "vllm", "vllm_hash_algo": "md5"}}, "kv.vllm_hash_algo"),
        ({"mixed": ["http://m:1"], "kv": {"tokenizer": "/nowhere/tokenizer"}}, "no tokenizer.json in /nowhere/tokenizer"),
        ({"mixed": [{"url": "http://m:1", "kv_events_endpoint": "tcp://*:port"}]}, "tcp://HOST:PORT"),
        ({"mixed": ["http://m:1"], "workers": 2}, "workers > 1 needs admin_port"),
        ({"mixed": ["http://m:1"], "auth": {"api_keys_file": "/nowhere/keys"}}, "cannot read secret file /nowhere/keys"),
        ({"models": ["tiny"]}, "no instances"),
    ],
)
def test_a_bad_config_exits_2_with_its_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], settings: dict[str, object], said: str
) -> None:
    code, out, err = _check(capsys, "--config", _config(tmp_path, settings), "--check")
    assert code == 2 and not out
    (line,) = err.splitlines()
    assert line.startswith(f"{CHECK}: ") and said in line, line


def test_the_command_line_check_prints_no_traceback(tmp_path: Path) -> None:
    config = _config(tmp_path, {"mixed": ["http://m:1"], "kv": {"index": "indexer"}})
    done = subprocess.run(
        [sys.executable, "-m", "conductor", "serve", "--config", config, "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "kv.indexer_url" in done.stderr


def test_probe_reaches_every_worker_and_says_what_it_checked(
    workers: tuple[Emulator, Emulator], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p, d = workers
    code, out, err = _check(capsys, "--config", _events_config(tmp_path, p, d), "--model", "tiny", "--probe")
    assert code == 0, (out, err)
    assert "KV events from 1 of 1 prefill/mixed instances" in out[0]
    prefill, decode = _line(out, "prefill-0"), _line(out, "decode-0")
    assert prefill.startswith(f"prefill-0 (prefill {p.url}): ok: health 200; models tiny (max_model_len 4096)")
    assert "; tokenize " in prefill and " tokens for a short text" in prefill  # the emulator serves /tokenize
    assert f"kv events {p.kv_events_endpoint} accepts connections" in prefill
    assert decode.startswith(f"decode-0 (decode {d.url}): ok: health 200; models tiny")
    assert "tokenize" not in decode  # a decode never tokenizes for the gateway


def test_a_dead_worker_exits_1_naming_it(workers: tuple[Emulator, Emulator], capsys: pytest.CaptureFixture[str]) -> None:
    p, _ = workers
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, _ = _check(capsys, "--prefill", p.url, "--decode", dead, "--probe")
    assert code == 1
    assert _line(out, "prefill-0").startswith("prefill-0 (prefill") and ": ok: " in _line(out, "prefill-0")
    assert _line(out, "decode-0") == f"decode-0 (decode {dead}): FAILED: health FAILED: unreachable (ConnectError)"
    assert out[-1] == f"{CHECK}: 1 of 2 instances failed a check: decode-0"


def test_a_model_the_workers_do_not_serve_fails_the_probe(
    workers: tuple[Emulator, Emulator], capsys: pytest.CaptureFixture[str]
) -> None:
    p, d = workers
    code, out, _ = _check(capsys, "--prefill", p.url, "--decode", d.url, "--model", "big", "--probe")
    assert code == 1
    assert "models FAILED: serves tiny (max_model_len 4096); not big" in _line(out, "prefill-0")


def test_the_builtin_tokenizer_is_compared_with_the_workers(
    workers: tuple[Emulator, Emulator], capsys: pytest.CaptureFixture[str]
) -> None:
    p, d = workers  # the emulator tokenizes UTF-8 bytes, as the built-in tokenizer does
    code, out, _ = _check(capsys, "--prefill", p.url, "--decode", d.url, "--tokenizer", "builtin", "--probe")
    assert code == 0 and "; tokenize " in _line(out, "prefill-0")


@contextmanager
def _listening() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_kv_events_address_the_gateway_cannot_bind_fails(
    workers: tuple[Emulator, Emulator], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p, d = workers
    with _listening() as port:  # a concrete address: the worker connects, so the gateway must bind it
        prefill = {"url": p.url, "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}
        code, out, _ = _check(capsys, "--config", _config(tmp_path, {"prefill": [prefill], "decode": [d.url]}), "--probe")
    assert code == 1
    assert f"kv events FAILED: the gateway binds tcp://127.0.0.1:{port}, and cannot" in _line(out, "prefill-0")


def test_a_free_kv_events_bind_address_passes(
    workers: tuple[Emulator, Emulator], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p, d = workers
    port = free_port()
    prefill = {"url": p.url, "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}
    code, out, _ = _check(capsys, "--config", _config(tmp_path, {"prefill": [prefill], "decode": [d.url]}), "--probe")
    assert code == 0 and f"kv events tcp://127.0.0.1:{port} free to bind" in _line(out, "prefill-0")


def test_a_worker_without_tokenize_is_the_auto_fallback_and_a_block_size_mismatch_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    info = 'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True"} 1.0\n'
    with serve(StandIn(model="tiny", metrics_text=info)) as worker:
        code, out, _ = _check(capsys, "--mixed", worker.url, "--probe")
        line = _line(out, "mixed-0")
        assert code == 1
        assert "tokenize not served: kv.tokenizer auto would use the built-in byte tokenizer" in line
        assert "block size FAILED: the worker's is 32, block_size here is 16" in line
        code, out, _ = _check(capsys, "--mixed", worker.url, "--block-size", "32", "--probe")
        assert code == 0 and "block size 32" in _line(out, "mixed-0")
