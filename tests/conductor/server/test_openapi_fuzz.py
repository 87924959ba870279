"""Schemathesis against the gateway's own /openapi.json, over real sockets: valid and invalid
requests for every operation, with KV awareness off and on. The stand-in workers answer every
request they get, so any 5xx is the gateway's fault; there must be none.

Bounded: a fixed number of examples per operation and generation mode, derandomized (the same
cases on every run), no deadline; about 20 s in all on two cores."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest

from tests.support.ci import require_import

schemathesis = require_import("schemathesis", "the test extra installs schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from conductor.config.settings import load_settings, merge_settings  # noqa: E402
from conductor.gateway import Gateway  # noqa: E402
from tests.support.servers import serve, serve_gateway  # noqa: E402
from tests.support.standin import StandIn  # noqa: E402

MAX_EXAMPLES = 30  # per operation and generation mode
MODEL = "tiny"
ANSWER_TOKENS = 4


class _BriefStandIn(StandIn):
    """A stand-in worker that answers every request with a few tokens, whatever max_tokens asks
    (the schema allows 16M): the gateway still sees and routes the client's own value."""

    async def _answer(self, send: Any, path: str, body: dict[str, Any], rid: str) -> None:
        brief = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
        await super()._answer(send, path, {**brief, "max_tokens": ANSWER_TOKENS}, rid)


@contextmanager
def _gateway(**overrides: Any) -> Iterator[str]:
    """A gateway (nixl P/D) over one prefill and one decode stand-in; yields its URL."""
    with ExitStack() as stack:
        prefill = stack.enter_context(serve(_BriefStandIn(role="prefill", model=MODEL)))
        decode = stack.enter_context(serve(_BriefStandIn(role="decode", model=MODEL)))
        options = {
            "prefill": [{"url": prefill.url}],
            "decode": [decode.url],
            "models": [MODEL],
            "health": {"interval_s": 0.5},
        }
        options = merge_settings(options, overrides)
        gateway = Gateway(load_settings(environ={}, overrides=options))
        yield stack.enter_context(serve_gateway(gateway)).url


def _served_model(case: Any) -> None:
    # Generated model names are almost never served: they would all stop at the 404 and the
    # analysis, admission and forwarding behind it would go untested. Name the served one.
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and case.body["model"]:
        case.body["model"] = MODEL


def _fuzz(url: str) -> list[str]:
    """Every 5xx the gateway answered, as curl commands that reproduce it."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    for operation in operations:
        takes_input = any(len(part) for part in (operation.body, operation.headers, operation.query))
        # an operation that takes nothing (GET /health) has no invalid request to make
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,)
        for mode in modes:

            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                _served_model(case)
                response = case.call(base_url=url, timeout=30)
                if response.status_code >= 500:
                    failures.append(f"{response.status_code} {response.text[:300]}\n  {case.as_curl_command(base_url=url)}")

            run()
    return failures


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv", [{}, {"enabled": True}], ids=["kv-off", "kv-on"])
def test_no_5xx_from_the_gateway(kv: dict[str, Any]) -> None:
    with _gateway(kv=kv) as url:
        failures = _fuzz(url)
    assert not failures, "the gateway answered 5xx:\n" + "\n".join(failures)
