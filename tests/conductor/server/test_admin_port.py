"""The OpenAPI document describes the plain ASGI POST routes; with `--admin-port` the operational
routes (/metrics, /openapi.json, /docs) move to a second server in the same process, sharing the
gateway, and the public port answers 404 for them. Without one, and with client keys, they take a
key on the public port (`auth.public_metrics` opens /metrics); /docs loads nothing from elsewhere."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.support.cluster import cluster
from tests.support.servers import free_port, serve
from tests.support.standin import StandIn
from tests.support.waiting import wait_for

ERROR_STATUSES = {"400", "404", "413", "429", "502", "503", "504"}


def test_openapi_describes_the_post_routes() -> None:
    with cluster("nixl", models=["tiny"]) as c:
        doc = httpx.get(c.url + "/openapi.json").json()
        assert httpx.get(c.url + "/metrics").status_code == 200
        assert httpx.get(c.url + "/docs").status_code == 200
    schemas = doc["components"]["schemas"]
    for path, body in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}
        assert set(op["responses"]) == {"200"} | ERROR_STATUSES  # no keys configured: no 401
        for status in ERROR_STATUSES:
            content = op["responses"][status]["content"]["application/json"]
            assert content["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "x-should-retry" in op["responses"]["429"]["headers"]
        assert "security" not in op
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["oneOf"]
    assert {"type": "string", "minLength": 1} in prompt
    ids = next(p for p in prompt if p.get("items", {}).get("type") == "integer")
    assert ids["items"] == {"type": "integer", "minimum": 0, "exclusiveMaximum": 2**31}
    assert schemas["CompletionRequest"]["required"] == ["model", "prompt"]
    assert schemas["CompletionRequest"]["additionalProperties"] is True  # unknown fields pass through
    assert schemas["ErrorResponse"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]


def test_openapi_documents_401_when_keys_are_configured() -> None:
    with cluster("nixl", models=["tiny"], auth={"api_keys": ["sk-1"]}) as c:
        doc = httpx.get(c.url + "/openapi.json", headers={"Authorization": "Bearer sk-1"}).json()
    op = doc["paths"]["/v1/completions"]["post"]
    assert "401" in op["responses"] and op["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


OPERATIONAL = ("/metrics", "/openapi.json", "/docs")


def _status(url: str, key: str | None = None) -> int:
    return httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30).status_code


def test_with_client_keys_the_operational_routes_on_the_public_port_need_a_key() -> None:
    with cluster("nixl", models=["tiny"], auth={"api_keys": ["sk-1"]}) as c:
        for path in OPERATIONAL:
            r = httpx.get(c.url + path, timeout=30)
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error", path
            assert _status(c.url + path, "sk-wrong") == 401, path
            assert _status(c.url + path, "sk-1") == 200, path  # no admin key set: the client key opens them
        for path in ("/health", "/ready"):  # probes never carry a key
            assert _status(c.url + path) == 200, path


def test_an_admin_key_is_what_opens_them_when_admin_keys_are_set() -> None:
    with cluster("nixl", models=["tiny"], auth={"api_keys": ["sk-1"], "admin_api_keys": ["adm-1"]}) as c:
        for path in OPERATIONAL:
            assert _status(c.url + path, "sk-1") == 401, path  # a tenant's key does not read the fleet's metrics
            assert _status(c.url + path, "adm-1") == 200, path
        r = httpx.post(
            c.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"Authorization": "Bearer adm-1"}
        )
        assert r.status_code == 401  # and an admin key is no client key


def test_public_metrics_opens_metrics_alone_for_a_scrape_without_credentials() -> None:
    with cluster("nixl", models=["tiny"], auth={"api_keys": ["sk-1"], "public_metrics": True}) as c:
        assert _status(c.url + "/metrics") == 200
        assert _status(c.url + "/openapi.json") == 401
        assert _status(c.url + "/docs") == 401


def test_without_client_keys_the_operational_routes_stay_open() -> None:
    with cluster("nixl", models=["tiny"]) as c:
        for path in OPERATIONAL:
            assert _status(c.url + path) == 200, path


def test_docs_is_one_self_contained_page_that_lists_the_routes() -> None:
    with cluster("nixl", models=["tiny"]) as c:
        r = httpx.get(c.url + "/docs", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    # nothing loaded from anywhere: no script, style sheet, image or frame with a source, no URL at all
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", page, re.IGNORECASE)
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    # and the browser is told so: only the page's own inline script and style may run
    policy = dict(part.strip().split(" ", 1) for part in r.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'"
    scripts = re.findall(r"<script>(.*?)</script>", page, re.DOTALL)
    styles = re.findall(r"<style>(.*?)</style>", page, re.DOTALL)
    assert len(scripts) == 1 and len(styles) == 1
    assert policy["script-src"] == _sha256_source(scripts[0]) and policy["style-src"] == _sha256_source(styles[0])
    # the document rides in the page: every route of the API, ready for the script to list
    data = re.search(r'<script type="application/json" id="openapi">(.*?)</script>', page, re.DOTALL)
    assert data is not None and "</" not in data.group(1)
    doc = json.loads(data.group(1))
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])


def _sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.fixture
def gateway_process() -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """`conductor serve --admin-port` in a subprocess, in front of one in-process stand-in."""
    with serve(StandIn(role="mixed", model="tiny")) as worker:
        port, admin_port = free_port(), free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "conductor",
                "serve",
                "--mixed",
                worker.url,
                "--model",
                "tiny",
                "--port",
                str(port),
                "--admin-port",
                str(admin_port),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        public, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        try:
            up = wait_for(lambda: _answers(public + "/ready") and _answers(admin + "/health"), timeout=30)
            assert up, proc.stdout.read() if proc.poll() is not None and proc.stdout else "not up"
            yield public, admin, proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_admin_port_serves_metrics_and_docs_and_the_public_port_does_not(
    gateway_process: tuple[str, str, subprocess.Popen[str]],
) -> None:
    public, admin, proc = gateway_process
    for path in ("/metrics", "/openapi.json", "/docs"):
        r = httpx.get(public + path)
        assert r.status_code == 404, path
        assert r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(admin + path).status_code == 200, path
    for base in (public, admin):
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/ready").json()["ready"] is True
    assert httpx.post(admin + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code in (404, 405)
    # one gateway behind both: a request on the public port shows in the admin port's metrics
    r = httpx.post(public + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    metrics = httpx.get(admin + "/metrics").text
    assert 'conductor_requests_total{route="/v1/completions",status="200"} 1.0' in metrics
    doc = httpx.get(admin + "/openapi.json").json()  # the public port's API, documented on the admin port
    assert "post" in doc["paths"]["/v1/chat/completions"]
    # SIGTERM stops both servers, and the process ends
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not _answers(admin + "/health") and not _answers(public + "/health")
