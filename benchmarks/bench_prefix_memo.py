"""Block keys per prompt with and without the prefix memo (conductor/core/prefix_memo.py), side by
side in one run, for every key scheme the gateway offers.

    python benchmarks/bench_prefix_memo.py [--prompts 200] [--tokens 8192] [--shared 0.75]

Workloads: `shared` -- every prompt starts with one of 8 system prompts (the `--shared` share of its
length) and ends in its own tokens, as agent and chat traffic does; `distinct` -- no two prompts
share a block (the memo's worst case: all cost, no reuse). Printed: CPU microseconds per prompt for
the scheme alone and through the memo, their ratio, and the memo's share of reused blocks.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conductor.core.block_keys import ResumableKeys, VllmKeys, XxhashKeys
from conductor.core.prefix_memo import PrefixMemo


def prompts(kind: str, n: int, tokens: int, shared: float, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(150_000) for _ in range(int(tokens * shared))] for _ in range(8)]
    out = []
    for _ in range(n):
        if kind == "shared":
            head = rng.choice(systems)
            out.append(head + [rng.randrange(150_000) for _ in range(tokens - len(head))])
        else:
            out.append([rng.randrange(150_000) for _ in range(tokens)])
    return out


def cpu_us(fn: object, batch: list[list[int]]) -> float:
    t0 = time.process_time()
    for p in batch:
        fn(p)  # type: ignore[operator]
    return (time.process_time() - t0) / len(batch) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shared", type=float, default=0.75)
    args = ap.parse_args()
    schemes: list[tuple[str, ResumableKeys]] = [
        ("xxhash (own), block 16", XxhashKeys(16)),
        ("vllm sha256, block 16", VllmKeys(16, "sha256", "0")),
        ("vllm sha256_cbor, block 16", VllmKeys(16, "sha256_cbor", None)),
        ("vllm xxhash, block 16", VllmKeys(16, "xxhash", "0")),
    ]
    print(f"{args.prompts} prompts of {args.tokens} tokens; shared: {args.shared:.0%} of each is one of 8 system prompts")
    print(f"{'scheme':<28} {'workload':<9} {'scheme us':>10} {'memo us':>9} {'memo/scheme':>11} {'reused':>7}")
    for name, scheme in schemes:
        for kind in ("shared", "distinct"):
            batch = prompts(kind, args.prompts, args.tokens, args.shared)
            memo = PrefixMemo(scheme)
            for p in batch:  # the answers must agree before any time counts
                assert memo.keys(p) == scheme.keys(p)
            memo = PrefixMemo(scheme)
            plain = cpu_us(scheme.keys, batch)
            memoised = cpu_us(memo.keys, batch)
            reused = memo.reused_blocks / max(memo.reused_blocks + memo.hashed_blocks, 1)
            print(f"{name:<28} {kind:<9} {plain:>10.0f} {memoised:>9.0f} {memoised / plain:>10.2f}x {reused:>7.0%}")


if __name__ == "__main__":
    main()
