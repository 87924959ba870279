"""The routing explainer (`POST /admin/explain`, `conductor explain`): the decision the gateway would
make for a request now and why, with nothing sent and nothing changed.

A real gateway with the kvcache_aware policy in front of emulated P/D workers (subprocesses, over
HTTP). What may differ between an explanation and the decision then made for the same request is
the request's own id (and its sequence number, had another decision come between); with nothing
else in flight the placement and every prediction are the same, to the figure the decision log
writes. So the tests compare them exactly, after waiting for the requests before to be over (their
observations teach the predictors, which would move the next prediction)."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conductor.config.settings import load_settings
from conductor.gateway import Gateway
from tests.support.emulator import start_emulator
from tests.support.prom import scrape
from tests.support.servers import serve_gateway
from tests.support.waiting import wait_for

ADMIN_KEY = "adm-explain"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
REPO = Path(__file__).resolve().parents[3]
# the keys a candidate's decision-log record has besides the policy's named components
_RECORD_KEYS = ("instance", "role", "score", "predicted_ttft_s", "predicted_tbt_s")


@dataclass
class Served:
    url: str
    gateway: Gateway


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with ExitStack() as stack:
        emu = {"model": "tiny", "time_scale": 0.01, "log_level": "warning"}
        prefills = [stack.enter_context(start_emulator("prefill", "nixl", **emu)) for _ in range(2)]
        decode = stack.enter_context(start_emulator("decode", "nixl", **emu))
        settings = load_settings(
            environ={},
            overrides={
                "prefill": [{"url": p.url} for p in prefills],
                "decode": [decode.url],
                "policy": "kvcache_aware",
                "auth": {"admin_api_keys": [ADMIN_KEY]},
                "logs": {"level": "warning"},
            },
        )
        gateway = Gateway(settings)
        server = stack.enter_context(serve_gateway(gateway))
        yield Served(server.url, gateway)


def _idle(s: Served) -> None:
    """Wait until every request sent before is over and observed (the in-flight count drops after
    the router observed it), so nothing in flight moves the next prediction."""
    registry = s.gateway.registry
    assert wait_for(
        lambda: s.gateway.inflight.count == 0 and all(not st.prefills and not st.decodes for st in registry.states.values())
    )


def _body(seed: int, **extra: Any) -> dict[str, Any]:
    rng = random.Random(seed)  # a prompt no other test sends: nothing of it is cached anywhere
    return {"model": "tiny", "prompt": [rng.randrange(1, 250) for _ in range(96)], "max_tokens": 4, **extra}


def _explain(s: Served, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    r = httpx.post(s.url + "/admin/explain", json=body, headers={**ADMIN, **headers}, timeout=30)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _decisions(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "conductor.decisions"]


def _same_prediction(explained: dict[str, Any], logged: dict[str, Any]) -> None:
    for key in (
        "policy",
        "prompt_tokens",
        "prefill",
        "decode",
        "predicted_ttft_s",
        "predicted_tbt_s",
        "pull_from",
        "pull_tokens",
    ):
        assert explained[key] == logged[key], key
    assert explained["unlisted_candidates"] == logged["unlisted_candidates"]
    assert len(explained["candidates"]) == len(logged["candidates"])
    for e, lc in zip(explained["candidates"], logged["candidates"], strict=True):
        for key in _RECORD_KEYS:
            assert e[key] == lc.get(key), (e["instance"], key)
        assert e["detail"] == {k: v for k, v in lc.items() if k not in _RECORD_KEYS}, e["instance"]


def test_the_explained_decision_is_the_one_made(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conductor.decisions")
    body = _body(1)
    _idle(served)
    explained = _explain(served, body)
    assert explained["verdict"] == {
        "admitted": True,
        "status": 200,
        "reason": None,
        "message": None,
        "predicted_s": None,
        "slo_s": None,
        "retry_after_s": None,
        "retryable": True,
    }
    assert explained["policy"] == "kvcache_aware" and explained["prompt_tokens"] == 96 and explained["exact"] is True
    assert explained["predicted_ttft_s"] > 0 and explained["decode"] == "decode-0"
    chosen = [c for c in explained["candidates"] if c["chosen"]]
    assert {c["instance"] for c in chosen} == {explained["prefill"], "decode-0"}
    prefill = next(c for c in chosen if c["role"] == "prefill")
    assert {"queue_s", "transfer_s", "prefill_s", "handoff_s", "cached_tokens", "pulled_tokens"} <= set(prefill["detail"])
    assert not _decisions(caplog)  # explaining is no decision: nothing logged
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    (logged,) = _decisions(caplog)
    assert logged["request_id"] != explained["request_id"]  # the one thing that differs
    _same_prediction(explained, logged)


def test_an_explained_rejection_is_the_rejection_sent(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conductor.decisions")
    body = _body(2)
    _idle(served)
    explained = _explain(served, body, **{"x-slo-ttft-ms": "0.001"})
    verdict = explained["verdict"]
    assert verdict["admitted"] is False and verdict["status"] == 429 and verdict["reason"] == "ttft_slo"
    assert verdict["slo_s"] == 0.000001 and verdict["predicted_s"] == explained["predicted_ttft_s"]
    assert "exceeds the TTFT SLO" in verdict["message"] and verdict["retryable"] is False
    assert explained["prefill"] is None and explained["decode"] is None
    r = httpx.post(served.url + "/v1/completions", json=body, headers={"x-slo-ttft-ms": "0.001"}, timeout=30)
    assert r.status_code == 429
    error = r.json()["error"]
    assert error["code"] == "ttft_slo" and error["message"] == verdict["message"]  # the same figures in it
    (logged,) = _decisions(caplog)
    assert logged["rejection"]["reason"] == "ttft_slo"
    _same_prediction(explained, logged)


def _state(s: Served) -> dict[str, Any]:
    """What a decision acted upon would change: in-flight accounting, the policy's memory, the
    decision metrics."""
    policy: Any = s.gateway.policy
    return {
        "gateway_inflight": s.gateway.inflight.count,
        "registry": {n: (dict(st.prefills), dict(st.decodes)) for n, st in s.gateway.registry.states.items()},
        "policy_inflight": len(policy.inflight),
        "pending_predictions": len(policy.learner.pending),
        "decisions": scrape(s.url, "conductor_decisions_total"),
        "rejections": scrape(s.url, "conductor_rejections_total"),
    }


def test_explaining_changes_nothing(served: Served) -> None:
    body = _body(3)
    _idle(served)
    before = _state(served)
    first = _explain(served, body)
    second = _explain(served, body, **{"x-slo-ttft-ms": "0.001"})  # a rejection is no state either
    third = _explain(served, body)
    assert _state(served) == before
    assert first["request_id"] != third["request_id"]
    assert {**first, "request_id": ""} == {**third, "request_id": ""}  # the same answer twice
    assert second["verdict"]["reason"] == "ttft_slo"
    # nothing entered the index: no instance holds the prompt, before or after explaining
    assert first["cached"] == third["cached"] == {}
    assert all(c["indexed_cached_tokens"] == 0 for c in third["candidates"])
    # no sequence number taken: the request sent now is the decision numbered as explained, and
    # what it leaves in the index (the dispatch record) shows in the next explanation
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    _idle(served)
    after = _explain(served, body)
    assert after["seq"] == first["seq"] + 1
    held = (96 - 1) // 16 * 16  # its whole blocks short of the last token (which a prefill always computes)
    assert after["cached"] == {first["prefill"]: held}
    assert next(c for c in after["candidates"] if c["instance"] == first["prefill"])["indexed_cached_tokens"] == held


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"authorization": "Bearer wrong"}, 401), ({"authorization": f"Bearer {ADMIN_KEY}"}, 200)],
)
def test_explain_takes_the_admin_key(served: Served, headers: dict[str, str], status: int) -> None:
    r = httpx.post(served.url + "/admin/explain", json=_body(4), headers=headers, timeout=30)
    assert r.status_code == status
    if status != 200:
        assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("content", "query", "status", "param"),
    [
        (b"{not json", "", 400, None),
        (b'{"model": "tiny"}', "", 400, "prompt"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', "", 400, "max_tokens"),
        (b'{"model": "tiny", "messages": "hi"}', "", 400, "messages"),
        (b'{"model": "tiny", "prompt": "x"}', "?kind=embeddings", 400, "kind"),
        (b'{"model": "nope", "prompt": "x"}', "", 404, "model"),
    ],
)
def test_a_malformed_body_is_an_openai_error(served: Served, content: bytes, query: str, status: int, param: str | None) -> None:
    r = httpx.post(served.url + "/admin/explain" + query, content=content, headers={**ADMIN, "content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def _cli(args: list[str], stdin: bytes | None = None, key: str | None = ADMIN_KEY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CONDUCTOR_ADMIN_KEY"}
    if key is not None:
        env["CONDUCTOR_ADMIN_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "conductor", "explain", *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        timeout=60,
        check=False,
    )


def test_conductor_explain_prints_the_decision(served: Served, tmp_path: Path) -> None:
    body = _body(5, stream=True)
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    _idle(served)
    table = _cli([str(path), "--url", served.url])
    assert table.returncode == 0, table.stderr
    as_json = _cli(["--url", served.url, "--json"], stdin=path.read_bytes())
    assert as_json.returncode == 0, as_json.stderr
    answer = json.loads(as_json.stdout)
    assert answer["verdict"]["admitted"] is True and answer["stream"] is True
    lines = table.stdout.splitlines()
    assert "verdict: admitted (HTTP 200)" in lines
    assert f"placement: prefill {answer['prefill']} -> decode decode-0; pull: none" in lines
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("prefill-", "decode-"))}
    assert set(rows) == {c["instance"] for c in answer["candidates"]}
    assert rows[answer["prefill"]][2] == "*"  # the chosen prefill is marked


def test_conductor_explain_says_why_it_would_be_refused(served: Served) -> None:
    rejected = _cli(["--url", served.url, "--slo-ttft-ms", "0.001"], stdin=json.dumps(_body(6)).encode())
    assert rejected.returncode == 0, rejected.stderr
    assert "verdict: REJECTED, HTTP 429 ttft_slo, retrying cannot help: predicted TTFT" in rejected.stdout
    no_key = _cli(["--url", served.url], stdin=json.dumps(_body(6)).encode(), key=None)
    assert no_key.returncode == 1
    assert "HTTP 401" in no_key.stderr and "admin API key" in no_key.stderr
    bad = _cli(["--url", served.url], stdin=b'{"model": "tiny"}')
    assert bad.returncode == 1 and "HTTP 400" in bad.stderr
