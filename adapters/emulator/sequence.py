"""One request inside the emulated engine (engine.py): its prompt, its tokens as they come, what it
holds in the prefix cache and the times the engine modelled for it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from adapters.emulator.kv_content import Taint
from adapters.emulator.lora import LoraAdapter
from adapters.emulator.metrics import RequestTimes
from adapters.emulator.openai_format import sample_seed


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine. `tokens` yields 0, 1, 2... per generated token, then None."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    digests: list[bytes]
    arrival: float
    kv_seed: int  # content seed of the KV this sequence runs on: the generated text follows it
    sample: int = 0  # which of its prompt's n choices (n > 1) it is: the others sample other text
    pooling: bool = False  # an embedding request: one forward pass over the prompt, no token generated
    lora: LoraAdapter | None = None  # the adapter it runs with (its digests include it); None: the base model
    kv_taint: Taint | None = None  # where its KV stops being its tokens' (kv_content.py); None: clean
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    cached_tokens: int = 0  # served from this instance's prefix cache
    external_tokens: int = 0  # received from a remote prefill (or pulled back from a decode)
    preloaded: bool = False  # external KV already in cache: the prefill step computes only the rest
    pin_on_finish: bool = False  # keep the blocks after finishing, until `Engine.unpin`
    held_blocks: int = 0  # leading digests this sequence pins in the cache
    generated: int = 0
    computed: int = 0  # prompt tokens prefilled here so far (a chunked prefill advances it step by step)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    aborted: bool = False
    finished: bool = False
    arrival_index: int = 0  # submission order in this engine (FCFS is checked against it)
    priority: int = 0  # the request's `priority`: lower first, under the priority scheduling policy
    prefill_step: int | None = None  # the engine step that computed the prompt (its last chunk)
    modelled_queue_s: float = 0.0  # modelled time between arrival and its prefill step
    modelled_prefill_s: float | None = None  # modelled duration of that step (of all its chunks' steps)
    modelled_transfer_s: float | None = None  # remote-KV decode legs: modelled KV transfer

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def text_seed(self) -> int:
        """What its generated words come from: its KV's content, and which sample it is."""
        return sample_seed(self.kv_seed, self.sample)

    def times(self, now: float) -> RequestTimes:
        """Its wall-clock phases, finished at `now` (its first token is out)."""
        scheduled = self.scheduled_at if self.scheduled_at is not None else self.arrival
        first = self.first_token_at if self.first_token_at is not None else now
        return RequestTimes(
            queue_s=scheduled - self.arrival,
            prefill_s=first - scheduled,
            decode_s=now - first,
            e2e_s=now - self.arrival,
            ttft_s=first - self.arrival,
        )
