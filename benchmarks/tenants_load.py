"""The two-class, two-tenant workload of benchmarks/bench_tenants.py: build it, send it, score it.

A request belongs to a tenant (its API key) and a class: `interactive` (urgent: short prompt, short
answer, tight SLOs) or `batch` (sheddable: long prompt, longer answer, loose SLOs). Arrivals are
Poisson per tenant. Each tenant's prompts start with its own system prompt (so a prefix cache has
something to keep) and go on with random text; one character is one token for the emulators' byte
tokenizer and for Conductor's builtin one, so every router sees the same prompt lengths.

Scoring, per class and per tenant: the share admitted (any answer but a 429), SLO attainment among
the admitted (a 200 whose TTFT and mean TBT meet its class's SLOs; an error is admitted and missed)
and over everything sent (a 429 is a miss).
"""

from __future__ import annotations

import asyncio
import random
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from traces.live_client import HttpOutcome, stream_completion

URGENT, SHEDDABLE = "interactive", "batch"
CLASSES = (URGENT, SHEDDABLE)
_ALPHABET = string.ascii_letters + string.digits + " "


@dataclass(frozen=True, slots=True)
class ClassShape:
    """A class's SLOs and request sizes (characters = tokens)."""

    ttft_s: float
    tbt_s: float
    prompt: tuple[int, int]  # the random part's length, min..max
    output: tuple[int, int]  # max_tokens, min..max


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float
    tenant: str
    cls: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Sent:
    request: Request
    outcome: HttpOutcome


def shapes(time_scale: float) -> dict[str, ClassShape]:
    """The classes' SLOs (those of a fast GPU times the workers' time scale) and sizes."""
    return {
        URGENT: ClassShape(0.5 * time_scale, 0.04 * time_scale, (64, 384), (16, 48)),
        SHEDDABLE: ClassShape(10.0 * time_scale, 0.15 * time_scale, (768, 2048), (48, 128)),
    }


def workload(
    rates: Mapping[str, float],
    urgent_fraction: float,
    duration_s: float,
    classes: Mapping[str, ClassShape],
    seed: int,
    system_tokens: int = 256,
) -> list[Request]:
    """Poisson arrivals over `duration_s` for each tenant at its rate (req/s); each request is urgent
    with probability `urgent_fraction`. The same seed gives the same requests."""
    rng = random.Random(seed)
    out: list[Request] = []
    for tenant, rate in sorted(rates.items()):
        system = f"[{tenant}] " + _text(rng, system_tokens)
        t = rng.expovariate(rate)
        while t < duration_s:
            cls = URGENT if rng.random() < urgent_fraction else SHEDDABLE
            shape = classes[cls]
            body = _text(rng, rng.randint(*shape.prompt))
            out.append(Request(t, tenant, cls, system + body, rng.randint(*shape.output)))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda r: r.at_s)


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(_ALPHABET, k=n))


async def drive(
    url: str, model: str, requests: Sequence[Request], keys: Mapping[str, str], timeout_s: float = 300.0
) -> list[Sent]:
    """Send every request at its time, streamed, with its tenant's key and its class in `x-priority`."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sessions: dict[tuple[str, str], aiohttp.ClientSession] = {}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    try:
        for tenant, key in keys.items():
            for cls in CLASSES:
                headers = {"Authorization": f"Bearer {key}", "x-priority": cls}
                sessions[(tenant, cls)] = aiohttp.ClientSession(
                    base_url=url, connector=connector, connector_owner=False, timeout=timeout, headers=headers
                )
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(req: Request) -> Sent:
            await asyncio.sleep(max(0.0, start + req.at_s - loop.time()))
            body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True}
            return Sent(req, await stream_completion(sessions[(req.tenant, req.cls)], body))

        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        for s in sessions.values():
            await s.close()
        await connector.close()


def _miss(sent: Sent, classes: Mapping[str, ClassShape]) -> str:
    """Why a request missed: its 429 code or error kind, else the SLO it missed."""
    o = sent.outcome
    if o.status != "ok":
        return o.reason or o.status
    return "late_ttft" if o.ttft_s is None or o.ttft_s > classes[sent.request.cls].ttft_s else "slow_tbt"


def met(sent: Sent, classes: Mapping[str, ClassShape]) -> bool:
    """Whether the request got its answer within both of its class's SLOs."""
    o, shape = sent.outcome, classes[sent.request.cls]
    if o.status != "ok" or o.ttft_s is None or o.ttft_s > shape.ttft_s:
        return False
    return o.tbt_s is None or o.tbt_s <= shape.tbt_s


@dataclass(slots=True)
class Score:
    """One group's (a class, a tenant) counts."""

    sent: int = 0
    admitted: int = 0
    met: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # why missed (429 code, error, late_ttft, slow_tbt) -> count

    @property
    def admitted_share(self) -> float:
        return self.admitted / self.sent if self.sent else 0.0

    @property
    def met_admitted(self) -> float:
        return self.met / self.admitted if self.admitted else 1.0  # nothing admitted: nothing missed

    @property
    def met_sent(self) -> float:
        return self.met / self.sent if self.sent else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "admitted": self.admitted,
            "met": self.met,
            "admitted_share": self.admitted_share,
            "met_admitted": self.met_admitted,
            "met_sent": self.met_sent,
            "reasons": dict(self.reasons),
        }


def score(sent: Iterable[Sent], classes: Mapping[str, ClassShape]) -> dict[str, Score]:
    """Group -> its score; groups "class:<c>", "tenant:<t>", "tenant:<t>/<c>" and "all"."""
    out: dict[str, Score] = {}
    for s in sent:
        r, o = s.request, s.outcome
        ok = met(s, classes)
        for group in ("all", f"class:{r.cls}", f"tenant:{r.tenant}", f"tenant:{r.tenant}/{r.cls}"):
            g = out.setdefault(group, Score())
            g.sent += 1
            g.admitted += o.status != "rejected"
            g.met += ok
            why = _miss(s, classes) if not ok else None
            if why is not None:
                g.reasons[why] = g.reasons.get(why, 0) + 1
    return out
