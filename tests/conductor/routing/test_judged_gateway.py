"""Round robin under kvcache_aware's admission (`policy: judged`, policies/judged.py) through a real
gateway in front of stand-in NIXL workers: while the prefills hold every answer, each request admitted
queues behind the ones before it on its round-robin prefill, until the judge predicts a TTFT past
the SLO and the gateway answers 429 (ttft_slo) without forwarding; plain round robin forwards every
one of the same requests. Once the prefills answer, the admitted ones complete and the judge's
prediction errors are on /metrics."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import httpx

from conductor.core.types import RequestView, Slo
from policies.admission import TTFT_SLO
from policies.judged import JudgedPolicy
from policies.registry import load_policy
from tests.policies.cluster_builders import decode, prefill, snapshot
from tests.support.cluster import Cluster, cluster
from tests.support.prom import scrape
from tests.support.waiting import wait_for

PROMPT_TOKENS = 16384  # ~0.37 s predicted per prefill (the bundled profile): a queue grows fast
MAX_REQUESTS = 16  # 8 queued per prefill: far past any SLO below; the bound only a broken judge reaches
OPTIONS = {"place": "round_robin"}


def _slo() -> float:
    """A TTFT SLO 2.5x what the judge predicts for one request on an idle prefill: admitted there,
    rejected behind a few queued the same size."""
    judge = load_policy("judged", OPTIONS)
    request = RequestView("probe", 0, "tiny", PROMPT_TOKENS, 4)
    idle = judge.decide(request, snapshot(prefill("p0"), prefill("p1"), decode("d0")))
    assert idle.predicted_ttft_s is not None
    slo = 2.5 * idle.predicted_ttft_s
    assert judge.decide(replace(request, slo=Slo(ttft_s=slo)), snapshot(prefill("p0"), decode("d0"))).rejection is None
    return slo


def _send(c: Cluster, seq: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": [1 + (seq + i) % 250 for i in range(PROMPT_TOKENS)], "max_tokens": 4}
    return httpx.post(c.url + "/v1/completions", json=body, timeout=60)


def _flood(c: Cluster, pool: ThreadPoolExecutor, until_429: bool, n: int = MAX_REQUESTS) -> list[Future[httpx.Response]]:
    """Send up to `n` requests one after another, each once the one before is either at a prefill
    (admitted: held there) or answered (rejected); stop after the first 429 when `until_429`."""
    sent: list[Future[httpx.Response]] = []
    for seq in range(n):
        arrived = _forwarded(c)
        future = pool.submit(_send, c, seq)
        sent.append(future)
        assert wait_for(lambda f=future, k=arrived: f.done() or _forwarded(c) > k)  # type: ignore[misc]
        if future.done() and until_429:
            break
    return sent


def _forwarded(c: Cluster) -> int:
    return sum(len(p.requests) for p in c.prefills)


def test_round_robin_with_admission_answers_429_under_overload() -> None:
    slo = _slo()
    hold = threading.Event()
    policy = load_policy("judged", OPTIONS)
    assert isinstance(policy, JudgedPolicy)
    held = {"prefill": {"answer_after": hold}}
    with (
        cluster("nixl", n_prefill=2, policy=policy, standin=held, slo={"ttft_s": slo, "tbt_s": 5.0}) as c,
        ThreadPoolExecutor(MAX_REQUESTS) as pool,
    ):
        try:
            sent = _flood(c, pool, until_429=True)
            answered = sent[-1].done()  # while the prefills hold every answer: turned away
            counts = [len(p.requests) for p in c.prefills]
        finally:
            hold.set()
        assert answered, f"no request was turned away among {len(sent)}"
        rejected, admitted = sent[-1].result(), len(sent) - 1
        assert rejected.status_code == 429, rejected.text
        assert rejected.headers["x-conductor-reject-reason"] == TTFT_SLO and rejected.json()["error"]["code"] == TTFT_SLO
        assert 2 <= admitted < MAX_REQUESTS  # an idle prefill admitted it; a queue of them did not
        assert counts == [(admitted + 1) // 2, admitted // 2]  # round robin's placement: p0, p1, p0, ...
        assert all(f.result().status_code == 200 for f in sent[:-1])
        assert wait_for(lambda: c.gateway.inflight.count == 0)
        assert scrape(c.url, "conductor_rejections_total", reason=TTFT_SLO) == 1
        # the judge's prediction errors, exported as kvcache_aware's are: one prefill leg per admitted request
        assert scrape(c.url, "conductor_prediction_samples", component="queue_and_prefill") == admitted
    # the same requests under plain round robin: every one forwarded
    hold = threading.Event()
    held = {"prefill": {"answer_after": hold}}
    with (
        cluster("nixl", n_prefill=2, standin=held, slo={"ttft_s": slo, "tbt_s": 5.0}) as c,
        ThreadPoolExecutor(MAX_REQUESTS) as pool,
    ):
        try:
            sent = _flood(c, pool, until_429=False, n=admitted + 1)
            assert _forwarded(c) == admitted + 1
        finally:
            hold.set()
        assert all(f.result().status_code == 200 for f in sent)
