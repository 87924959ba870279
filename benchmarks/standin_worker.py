"""A stand-in vLLM worker in its own process, for benchmarks: answers instantly, records little."""

from __future__ import annotations

import argparse

import uvicorn

from tests.support.standin import StandIn


class _Lean(StandIn):
    """Keeps no request log: a benchmark sends tens of thousands of requests."""

    def __post_init__(self) -> None:
        self.requests = _Discard()  # type: ignore[assignment]
        self.finished = _Discard()  # type: ignore[assignment]


class _Discard(list):  # type: ignore[type-arg]
    def append(self, _item: object) -> None:
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="mixed")
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--model", help="serve this model only: /v1/models lists it, a request for another is a 404 (default: any, as tiny)"
    )
    a = p.parse_args()
    app = _Lean(role=a.role) if a.model is None else _Lean(role=a.role, model=a.model, models=(a.model,))
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", access_log=False, http="httptools", loop="uvloop")


if __name__ == "__main__":
    main()
