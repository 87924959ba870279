"""Timing effects of a real vLLM engine that the predictors' formula (conductor/core/profile.py) lacks.

Without them an emulated step lasts exactly what the profile's three formulas say, which are the
formulas the gateway's predictors fit: a good prediction would hold by construction. Each effect
is an option of the emulator (`conductor emulate` flags, EmulatorConfig), off by default because
the timing tests check the plain profile's figures exactly; the prediction benchmark turns all
three on. What vLLM V1 does (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`) and how it is
modelled here:

(b) Chunked prefill, `--max-num-batched-tokens N`. vLLM's step has a token budget of N: the running
    requests are scheduled first (a decode takes 1 token, a partial prefill the rest of its prompt
    up to what is left), then waiting requests while budget is left; a prompt longer than what is
    left is cut (`num_new_tokens = min(num_new_tokens, token_budget)`) and its prefill goes on at
    the next step, as a running request. Here: the one prefill in progress gets
    `N - running decodes` tokens a step (at least one block, so a full batch cannot starve it); each
    chunk is charged `T_prefill(chunk, context computed so far)` -- the quadratic terms of the
    chunks add up to the whole prompt's, but every chunk pays the step's fixed cost again, and the
    decodes riding in each chunk's step lengthen the prompt's time to first token. None: the whole
    prompt in one step (vLLM with chunked prefill off).
(a) Prefill-decode interference, `--mixed-batch-overhead a`. A decode that shares a step with a
    prefill chunk rides the prefill's GEMMs (the weights are read once), so only its marginal cost
    (TBT - decode_base) is added -- but it costs (1 + a) times what it costs in a decode-only step:
    vLLM captures full CUDA graphs only for uniform decode batches (cudagraph mode
    FULL_AND_PIECEWISE), so a mixed batch runs its attention eagerly through the varlen prefill
    path and pays the kernel launches a graph replay saves. Every token of the running streams
    produced in a mixed step is slower by that much; a=0 is the plain profile's rule.
(c) Slowdown near KV-cache capacity, `--kv-pressure-threshold u0 --kv-pressure-slowdown b`. When the
    running requests' KV no longer fits, vLLM preempts the last running request (RECOMPUTE: its
    blocks are freed, it goes back to the front of the waiting queue and its prompt and output are
    prefilled again later), so the work per useful token grows as usage nears the cache size.
    Modelled as a step stretch rather than explicit preemptions: with usage u = resident KV tokens
    of the running requests (and of the prefill in progress) / KV capacity, a step lasts
    (1 + b * min(1, (u - u0) / (1 - u0))) times its time once u > u0 -- the recompute's cost spread
    over the steps, rising from 0 at u0 to b at a full cache. b=0: no slowdown.
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.core.profile import Profile

MIN_CHUNK_TOKENS = 16  # a prefill in progress always advances by at least one block a step


@dataclass(frozen=True, slots=True)
class TimingEffects:
    """The three effects' settings; the defaults turn every one off (the plain profile)."""

    max_num_batched_tokens: int | None = None  # (b) the step's token budget; None: no chunking
    mixed_batch_overhead: float = 0.0  # (a) extra fraction of the decodes' cost in a mixed step
    kv_pressure_threshold: float = 0.9  # (c) KV usage where the slowdown starts
    kv_pressure_slowdown: float = 0.0  # (c) extra fraction of a step's time at a full cache

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < MIN_CHUNK_TOKENS:
            raise ValueError(f"max_num_batched_tokens must be at least {MIN_CHUNK_TOKENS}")
        if self.mixed_batch_overhead < 0 or self.kv_pressure_slowdown < 0:
            raise ValueError("mixed_batch_overhead and kv_pressure_slowdown must be >= 0")
        if not 0.0 <= self.kv_pressure_threshold < 1.0:
            raise ValueError("kv_pressure_threshold must be in [0, 1)")

    def chunk(self, remaining: int, decodes: int) -> int:
        """Prompt tokens a prefill in progress computes this step, next to `decodes` running decodes."""
        if self.max_num_batched_tokens is None:
            return remaining
        return min(remaining, max(self.max_num_batched_tokens - decodes, MIN_CHUNK_TOKENS))

    def pressure(self, usage: float) -> float:
        """Multiplier of a step's time at KV usage `usage` (effect c)."""
        if self.kv_pressure_slowdown <= 0 or usage <= self.kv_pressure_threshold:
            return 1.0
        over = (usage - self.kv_pressure_threshold) / (1.0 - self.kv_pressure_threshold)
        return 1.0 + self.kv_pressure_slowdown * min(1.0, over)

    def step_s(
        self,
        profile: Profile,
        prefill: tuple[int, int] | None,
        batch: int,
        kv_tokens: int,
        usage: float,
    ) -> float:
        """One engine step: `prefill` is (chunk tokens, context before it) or None; `batch` decodes
        holding `kv_tokens`; `usage` the KV usage. Unscaled profile seconds."""
        duration = 0.0
        if prefill is not None:
            duration += profile.prefill_s(*prefill)
        if batch:
            step = profile.decode_step_s(batch, kv_tokens)
            if prefill is None:
                duration += step
            else:  # (a): the decodes' marginal cost, slower in a mixed batch
                duration += (step - profile.decode_base_s) * (1.0 + self.mixed_batch_overhead)
        return duration * self.pressure(usage)
