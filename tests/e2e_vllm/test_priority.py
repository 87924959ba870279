"""A real vLLM engine started with `--scheduling-policy priority` receives each request's class priority
from the gateway (priority.classes.<c>.engine_priority, the instance's `scheduling_policy: priority`):
an urgent request queued behind batch ones is served first.

The engine runs one request at a time (`--max-num-seqs 1`), so its waiting queue is its only
ordering. A long request sent straight to the engine holds the one slot; two batch requests and then
an urgent one go through the gateway and are seen waiting in the engine's own metrics
(`vllm:num_requests_waiting`) while it runs. Once it ends vLLM takes the waiting request of the
lowest (priority, arrival) first. Through a gateway
that knows the engine schedules by priority the urgent request (priority 0) finishes before the batch
ones (3), which each run 160 tokens after it; through one that is not told so, no priority is sent
and the engine serves them as they came, the urgent one last.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e_vllm.engines import BLOCK_SIZE, MODEL_NAME, Engine, start_all, stop_all, words
from tests.e2e_vllm.gateway import run_gateway
from tests.support.waiting import wait_for

# the engine starts inside the first test's setup: far beyond the suite's 120 s default
pytestmark = pytest.mark.timeout(900)

PRIORITY = {
    "classes": {"interactive": {"rank": 0}, "batch": {"rank": 3, "sheddable": True}},  # engine priorities 0 and 3
    "default": "interactive",
}


@pytest.fixture(scope="module")
def engine(vllm_python: str, tiny_model: Path, e2e_dir: Path) -> Iterator[Engine]:
    e = Engine(
        "priority-0",
        vllm_python,
        tiny_model,
        e2e_dir / "priority",
        core=0,
        # after the shared flags: the last --max-num-seqs is the one vLLM keeps
        extra_args=("--scheduling-policy", "priority", "--max-num-seqs", "1"),
    )
    start_all([e])
    try:
        yield e
    finally:
        stop_all([e])


def waiting(engine: Engine) -> float:
    return engine.metric("vllm:num_requests_waiting")


def finish_order(engine: Engine, gateway_url: str, seed: int) -> list[str]:
    """The order in which two batch requests and then an urgent one, queued in that order behind a
    long request, come back through the gateway."""
    order: list[str] = []
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def send(url: str, name: str, cls: str, max_tokens: int, n: int) -> None:
        body = {"model": MODEL_NAME, "prompt": words(seed + n, 20), "max_tokens": max_tokens, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, headers={"x-priority": cls} if cls else {}, timeout=300)
        with lock:
            statuses[name] = r.status_code
            order.append(name)

    # straight to the engine: 1,900 tokens, about 11 s on a 2-core box, while the others queue
    threads = [threading.Thread(target=send, args=(engine.url, "long", "", 1900, 0))]
    threads[0].start()
    assert wait_for(lambda: engine.metric("vllm:num_requests_running") == 1, timeout=60), "the long request never ran"
    for queued, (name, cls, max_tokens) in enumerate(
        (("batch-1", "batch", 160), ("batch-2", "batch", 160), ("urgent", "interactive", 4)), start=1
    ):
        threads.append(threading.Thread(target=send, args=(gateway_url, name, cls, max_tokens, queued)))
        threads[-1].start()
        assert wait_for(lambda: waiting(engine) == queued, timeout=60), f"{name} never waited in the engine"  # noqa: B023
    for t in threads:
        t.join(timeout=300)
    assert statuses == {"long": 200, "batch-1": 200, "batch-2": 200, "urgent": 200}, statuses
    assert order[0] == "long", order  # the others all waited for it
    return order[1:]


def test_the_urgent_class_is_served_first_where_the_engine_schedules_by_priority(engine: Engine) -> None:
    common = {"policy": "round_robin", "block_size": BLOCK_SIZE, "kv": {"enabled": False}, "priority": PRIORITY}
    with run_gateway(mixed=[{"url": engine.url, "scheduling_policy": "priority"}], **common) as gw:
        assert finish_order(engine, gw.url, 5100) == ["urgent", "batch-1", "batch-2"]
    # the same engine behind a gateway not told it schedules by priority: nothing sent, arrival order
    with run_gateway(mixed=[{"url": engine.url}], **common) as gw:
        assert finish_order(engine, gw.url, 5200) == ["batch-1", "batch-2", "urgent"]
