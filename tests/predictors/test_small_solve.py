"""The written-out small solves are the general elimination, bit for bit."""

from __future__ import annotations

import math
import random

from predictors.small_solve import lin_solve, lin_solve_any, nnls


def _same(a: list[float] | None, b: list[float] | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and [repr(x) for x in a] == [repr(x) for x in b])


def _matrix(rng: random.Random, k: int) -> list[list[float]]:
    kind = rng.random()
    if kind < 0.1:  # exact ties and zeros: pivot choice and the zero-factor skip
        return [[float(rng.choice((0, 1, -1, 2))) for _ in range(k)] for _ in range(k)]
    if kind < 0.2:  # singular: a repeated row
        row = [rng.uniform(-1, 1) for _ in range(k)]
        return [list(row) for _ in range(k)]
    scale = [10 ** rng.uniform(-8, 8) for _ in range(k)]
    return [[rng.gauss(0, 1) * scale[i] * scale[j] for j in range(k)] for i in range(k)]


def test_written_out_solves_equal_the_general_loop() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        k = rng.choice((1, 2, 3))
        g = _matrix(rng, k)
        h = [rng.gauss(0, 1) * 10 ** rng.uniform(-3, 3) for _ in range(k)]
        assert _same(lin_solve(g, h), lin_solve_any(g, h)), (g, h)


def test_nnls_is_non_negative_and_no_worse_than_zero() -> None:
    rng = random.Random(3)
    for _ in range(2_000):
        k = rng.choice((2, 3))
        m = [[rng.gauss(0, 1) for _ in range(k)] for _ in range(k + 2)]
        g = [[sum(m[r][i] * m[r][j] for r in range(k + 2)) for j in range(k)] for i in range(k)]  # positive definite
        h = [rng.gauss(0, 1) for _ in range(k)]
        p = nnls(g, h)
        assert all(v >= 0 for v in p)
        cost = 0.5 * sum(p[i] * g[i][j] * p[j] for i in range(k) for j in range(k)) - sum(h[i] * p[i] for i in range(k))
        assert cost <= 1e-12 and not math.isnan(cost)
