"""The timing effects the predictors' formula lacks (adapters/emulator/effects.py), each checked on the
times the engine *modelled* (Sequence.modelled_*: profile times, never stretched by a busy host) and
its step count; and the mismatched A100 profile the prediction benchmark runs the workers on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from adapters.emulator.effects import TimingEffects
from adapters.emulator.engine import Engine, Sequence
from adapters.emulator.metrics import EngineMetrics
from adapters.emulator.prefix_cache import PrefixCache
from adapters.emulator.profile import Profile, load_profile
from conductor.core.vllm_hash import VllmBlockHasher
from tests.support.emulator import modelled, start_emulator

# Short steps (a few ms) so the tests run fast; the figures compared are the modelled ones.
PROFILE = Profile(
    prefill_base_s=0.001,
    prefill_per_token_s=1e-6,
    prefill_quad_s=1e-10,
    decode_base_s=0.001,
    decode_per_seq_s=1e-4,
    decode_per_kv_token_s=1e-7,
)
A100 = Path(__file__).resolve().parents[3] / "conductor/data/profiles/qwen3-8b-a100-roofline.yaml"


def engine(effects: TimingEffects, capacity_tokens: int = 100_000) -> Engine:
    hasher = VllmBlockHasher("sha256", 16, seed="x")
    return Engine(PROFILE, hasher, PrefixCache(16, capacity_tokens), EngineMetrics("m"), effects=effects)


async def drain(seq: Sequence) -> None:
    while await seq.tokens.get() is not None:
        pass


async def run(eng: Engine, requests: list[tuple[list[int], int]]) -> list[Sequence]:
    """Submit every request at once; wait for every stream to end."""
    eng.start()
    try:
        seqs = [eng.submit(f"r{i}", prompt, n) for i, (prompt, n) in enumerate(requests)]
        await asyncio.gather(*(drain(s) for s in seqs))
    finally:
        await eng.stop()
    return seqs


def prompt(k: int, n: int) -> list[int]:
    return [(k * 31 + i) % 250 + 1 for i in range(n)]


async def test_chunked_prefill_splits_a_long_prompt_into_budgeted_steps() -> None:
    whole = (await run(engine(TimingEffects()), [(prompt(0, 1000), 1)]))[0]
    chunked_engine = engine(TimingEffects(max_num_batched_tokens=256))
    chunked = (await run(chunked_engine, [(prompt(0, 1000), 1)]))[0]
    assert whole.modelled_prefill_s == pytest.approx(PROFILE.prefill_s(1000), rel=1e-12)
    # 256 + 256 + 256 + 232 tokens, four steps: the quadratic terms add up to the whole prompt's,
    # the fixed cost is paid once a chunk
    assert chunked_engine.steps == 4 and chunked.prefill_step == 3
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    assert chunked.modelled_prefill_s == pytest.approx(sum(PROFILE.prefill_s(n, c) for n, c in chunks), rel=1e-12)
    assert whole.modelled_prefill_s is not None
    assert chunked.modelled_prefill_s == pytest.approx(whole.modelled_prefill_s + 3 * PROFILE.prefill_base_s, rel=1e-12)


async def test_chunks_interleave_with_decodes_which_take_budget_first() -> None:
    # a stream decoding while a 600-token prompt is prefilled in chunks of 200 - 1 (its decode's token)
    eng = engine(TimingEffects(max_num_batched_tokens=200))
    stream, long = await run(eng, [(prompt(1, 32), 50), (prompt(2, 600), 1)])
    # the long prompt's first token waits for 4 chunked steps (199 + 199 + 199 + 3 tokens), in each
    # of which the stream produced a token: the stream is never stalled for a whole prefill
    assert long.prefill_step is not None and stream.prefill_step == 0
    assert long.prefill_step - stream.prefill_step == 4
    assert stream.generated == 50 and long.first_token_at is not None


async def decode_share(overhead: float) -> float:
    """What the decodes added to a prefill step they shared (the profile's prefill time taken out)."""
    _, second = await run(engine(TimingEffects(mixed_batch_overhead=overhead)), [(prompt(3, 64), 20), (prompt(4, 320), 1)])
    assert second.modelled_prefill_s is not None
    return second.modelled_prefill_s - PROFILE.prefill_s(320)


async def test_mixed_batch_overhead_slows_the_decodes_sharing_a_prefill_step() -> None:
    plain, slowed = await decode_share(0.0), await decode_share(1.5)
    # the first sequence (64 prompt tokens + 1 generated) rides in the second one's prefill step
    marginal = PROFILE.decode_step_s(1, 65) - PROFILE.decode_base_s
    assert plain == pytest.approx(marginal, rel=1e-9)
    assert slowed == pytest.approx(2.5 * marginal, rel=1e-9)


async def test_kv_pressure_stretches_steps_near_capacity() -> None:
    effects = TimingEffects(kv_pressure_threshold=0.5, kv_pressure_slowdown=2.0)
    # 1,600-token capacity; a 1,200-token prompt in its prefill step: usage 0.75, halfway from the
    # threshold to a full cache -> the step lasts 1 + 2.0 * 0.5 = 2x
    near = (await run(engine(effects, capacity_tokens=1600), [(prompt(5, 1200), 1)]))[0]
    roomy = (await run(engine(effects, capacity_tokens=100_000), [(prompt(5, 1200), 1)]))[0]
    assert roomy.modelled_prefill_s == pytest.approx(PROFILE.prefill_s(1200), rel=1e-12)
    assert near.modelled_prefill_s == pytest.approx(2.0 * PROFILE.prefill_s(1200), rel=1e-12)
    assert effects.pressure(1.5) == 3.0 and effects.pressure(0.5) == 1.0  # capped at a full cache


def test_effects_reject_bad_settings() -> None:
    with pytest.raises(ValueError):
        TimingEffects(max_num_batched_tokens=8)
    with pytest.raises(ValueError):
        TimingEffects(mixed_batch_overhead=-0.1)
    with pytest.raises(ValueError):
        TimingEffects(kv_pressure_threshold=1.0)


def test_mismatched_a100_profile_loads_with_another_shape() -> None:
    a100, bundled = load_profile(A100), load_profile()
    assert a100.name == "qwen3-8b-a100-roofline"
    assert isinstance(a100.transfer_bandwidth_bytes_s, float)  # "2.0e+10"; YAML 1.1 reads 2.0e10 as text
    # not a scale of the bundled profile: the slowdown differs by prompt length and by term
    short, long = (a100.prefill_s(n) / bundled.prefill_s(n) for n in (1024, 6144))
    assert short < 2.0 < 3.5 < long
    assert a100.decode_base_s > bundled.decode_base_s and a100.decode_per_kv_token_s < bundled.decode_per_kv_token_s


def test_a_profile_value_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("decode_base_s: fast\n")
    with pytest.raises(ValueError, match="decode_base_s"):
        load_profile(bad)


def test_the_flags_reach_the_engine_over_http() -> None:
    """`conductor emulate --max-num-batched-tokens 256 --mixed-batch-overhead ...` as a subprocess: a
    1,000-token prompt is prefilled in four budgeted chunks, each paying the step's fixed cost."""
    bundled = load_profile()
    tokens = prompt(6, 1000)
    with start_emulator("mixed", time_scale=1.0, noise=0.0, max_num_batched_tokens=256, mixed_batch_overhead=0.5) as emu:
        r = httpx.post(
            emu.url + "/v1/completions", json={"prompt": tokens, "max_tokens": 1}, headers={"X-Request-ID": "c"}, timeout=30
        )
        r.raise_for_status()
        times = modelled(emu, "c")
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    assert times["prefill_s"] == pytest.approx(sum(bundled.prefill_s(n, c) for n, c in chunks), rel=1e-9)
