"""/v1/embeddings and /v1/responses: vLLM serves both on mixed workers, so the gateway routes them
there with the openai SDK working unchanged; behind prefill/decode pairs they are a clear 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.cluster import cluster


def test_embeddings_and_responses_reach_a_mixed_worker_through_the_sdk() -> None:
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=2) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0)
        emb = client.embeddings.create(model="tiny", input=["one", "two"])
        assert [d.embedding for d in emb.data] == [[0.25, -0.5, 0.0], [0.25, -0.5, 1.0]]
        resp = client.responses.create(model="tiny", input="say x", max_output_tokens=3)
        assert resp.output_text == "x x x "
        paths = [r.path for w in c.mixed for r in w.requests]
        assert sorted(paths) == ["/v1/embeddings", "/v1/responses"]
        forwarded = next(r for w in c.mixed for r in w.requests if r.path == "/v1/responses")
        assert forwarded.body["input"] == "say x" and forwarded.body["max_output_tokens"] == 3
        assert forwarded.headers["x-request-id"] != ""  # the gateway's own id
        metrics = httpx.get(c.url + "/metrics").text
        assert 'conductor_requests_total{route="/v1/embeddings",status="200"} 1.0' in metrics


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": "tiny"}, "input"),
        ("/v1/embeddings", {"model": "tiny", "input": []}, "input"),
        ("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ("/v1/responses", {"input": "x"}, "model"),
    ],
)
def test_malformed_pass_through_bodies_are_400(path: str, body: dict[str, object], param: str) -> None:
    with cluster("nixl", n_prefill=0, n_decode=0, n_mixed=1) as c:
        r = httpx.post(c.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert not c.mixed[0].requests


def test_pass_through_routes_are_a_clear_400_in_pd() -> None:
    with cluster("nixl") as c:
        for path in ("/v1/embeddings", "/v1/responses"):
            r = httpx.post(c.url + path, json={"model": "tiny", "input": "x"})
            assert r.status_code == 400 and "mixed" in r.json()["error"]["message"]
        assert not c.prefills[0].requests and not c.decodes[0].requests
