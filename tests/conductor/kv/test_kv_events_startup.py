"""A KV events socket that cannot be opened at start-up (a port another process holds) stops the
gateway with one line naming the instance, the address and the setting: a ConfigError, not a
ZMQError traceback out of the ASGI lifespan."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conductor.core.errors import ConfigError
from conductor.core.types import Role
from conductor.kv.analyzer import build_analyzer
from tests.support.servers import free_port


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process's socket holds while the test runs."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


async def test_a_taken_kv_events_port_is_a_config_error_naming_instance_and_endpoint(taken_port: int) -> None:
    # a host in the endpoint: vLLM's PUB connects there, so the gateway binds it
    endpoint = f"tcp://127.0.0.1:{taken_port}"
    analyzer = build_analyzer(
        {"enabled": True, "tokenizer": "builtin", "kv_events": {"prefill-0": {"endpoint": endpoint}}},
        [("prefill-0", Role.PREFILL, "http://127.0.0.1:9")],
    )
    try:
        with pytest.raises(ConfigError) as failed:
            await analyzer.start()
    finally:
        await analyzer.close()
    message = failed.value.message
    for part in ("prefill-0", f"cannot bind {endpoint}", f"kv_events_endpoint {endpoint!r}", "Address already in use"):
        assert part in message, message


def test_conductor_serve_says_so_in_one_line(tmp_path: Path, taken_port: int) -> None:
    config = tmp_path / "conductor.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": ["tiny"],
                "mixed": [{"url": "http://127.0.0.1:9", "kv_events_endpoint": f"tcp://127.0.0.1:{taken_port}"}],
                "kv": {"enabled": True, "tokenizer": "builtin"},
            }
        )
    )
    command = [sys.executable, "-m", "conductor", "serve", "--config", str(config), "--port", str(free_port())]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert "Traceback" not in said and "ZMQError" not in said, said
    line = next(line for line in out.stderr.splitlines() if line.startswith("conductor serve: "))
    assert "KV events of instance mixed-0: cannot bind" in line and "kv_events_endpoint" in line, said
