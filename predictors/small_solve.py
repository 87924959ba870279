"""The k x k systems of the robust refits (predictors.linear), in Python floats.

Every refit solves a few Newton systems of 2 or 3 unknowns (the models' coefficients) and, when
the unconstrained solution has a negative coefficient, the same system on each support set. At
these sizes numpy's and LAPACK's call overhead is ten times the arithmetic, so the solves are
Gaussian elimination with partial pivoting (what LAPACK's gesv does) in plain floats. Systems of
1, 2 and 3 unknowns, which are all the models have, are written out: the same operations in the
same order as the general loop (`lin_solve_any`), so bit for bit its results (tested), at a
third of its cost.
"""

from __future__ import annotations

_SUBSETS: dict[int, list[list[int]]] = {}  # k -> the proper, non-empty support sets of k coefficients


def _subsets(k: int) -> list[list[int]]:
    if k not in _SUBSETS:
        # the full set is left out: its solution is the unconstrained one nnls has just rejected
        _SUBSETS[k] = [[i for i in range(k) if (m >> i) & 1] for m in range(1, (1 << k) - 1)]
    return _SUBSETS[k]


def lin_solve_any(g: list[list[float]], h: list[float]) -> list[float] | None:
    """G p = h for any number of unknowns: Gaussian elimination with partial pivoting (the first
    of equal pivots), None when a pivot is exactly zero (where gesv reports a singular matrix)."""
    k = len(h)
    m = [[*g[i], h[i]] for i in range(k)]
    for c in range(k):
        piv = c
        for r in range(c + 1, k):
            if abs(m[r][c]) > abs(m[piv][c]):
                piv = r
        if m[piv][c] == 0.0:
            return None
        if piv != c:
            m[c], m[piv] = m[piv], m[c]
        row = m[c]
        pv = row[c]
        for r in range(c + 1, k):
            other = m[r]
            f = other[c] / pv
            if f:  # a zero factor leaves the row as it is (even where the pivot row holds an inf)
                for j in range(c + 1, k + 1):
                    other[j] -= f * row[j]
    p = [0.0] * k
    for c in range(k - 1, -1, -1):
        row = m[c]
        s = row[k]
        for j in range(c + 1, k):
            s -= row[j] * p[j]
        p[c] = s / row[c]
    return p


def _solve1(g: list[list[float]], h: list[float]) -> list[float] | None:
    a = g[0][0]
    return None if a == 0.0 else [h[0] / a]


def _solve2(g: list[list[float]], h: list[float]) -> list[float] | None:
    (a0, b0), (a1, b1) = g
    h0, h1 = h
    if abs(a1) > abs(a0):  # pivot on the second row
        a0, b0, h0, a1, b1, h1 = a1, b1, h1, a0, b0, h0
    if a0 == 0.0:
        return None
    f = a1 / a0
    if f:
        b1 -= f * b0
        h1 -= f * h0
    if b1 == 0.0:
        return None
    p1 = h1 / b1
    return [(h0 - b0 * p1) / a0, p1]


def _solve3(g: list[list[float]], h: list[float]) -> list[float] | None:
    (a0, b0, c0), (a1, b1, c1), (a2, b2, c2) = g
    h0, h1, h2 = h
    # column 0: the pivot is the first row of the largest |a|, swapped with the first row
    if abs(a1) > abs(a0):
        if abs(a2) > abs(a1):
            a0, b0, c0, h0, a2, b2, c2, h2 = a2, b2, c2, h2, a0, b0, c0, h0
        else:
            a0, b0, c0, h0, a1, b1, c1, h1 = a1, b1, c1, h1, a0, b0, c0, h0
    elif abs(a2) > abs(a0):
        a0, b0, c0, h0, a2, b2, c2, h2 = a2, b2, c2, h2, a0, b0, c0, h0
    if a0 == 0.0:
        return None
    f = a1 / a0
    if f:
        b1 -= f * b0
        c1 -= f * c0
        h1 -= f * h0
    f = a2 / a0
    if f:
        b2 -= f * b0
        c2 -= f * c0
        h2 -= f * h0
    # column 1, rows 1 and 2
    if abs(b2) > abs(b1):
        b1, c1, h1, b2, c2, h2 = b2, c2, h2, b1, c1, h1
    if b1 == 0.0:
        return None
    f = b2 / b1
    if f:
        c2 -= f * c1
        h2 -= f * h1
    if c2 == 0.0:
        return None
    p2 = h2 / c2
    p1 = (h1 - c1 * p2) / b1
    s = h0 - b0 * p1
    s -= c0 * p2
    return [s / a0, p1, p2]


_SOLVERS = {1: _solve1, 2: _solve2, 3: _solve3}


def lin_solve(g: list[list[float]], h: list[float]) -> list[float] | None:
    """G p = h (see lin_solve_any), written out for up to 3 unknowns."""
    solver = _SOLVERS.get(len(h))
    return lin_solve_any(g, h) if solver is None else solver(g, h)


def nnls(g: list[list[float]], h: list[float]) -> list[float]:
    """argmin_{p >= 0} p'Gp/2 - h'p (G positive definite, a few coefficients): the unconstrained
    solution when it is non-negative, else the best over every support set (exact for small k)."""
    p = lin_solve(g, h)
    if p is not None and all(v >= 0 for v in p):  # False with a NaN too
        return p
    k = len(h)
    best, best_cost = [0.0] * k, 0.0  # p = 0 costs 0
    for idx in _subsets(k):
        sub = lin_solve([[g[i][j] for j in idx] for i in idx], [h[i] for i in idx])
        if sub is None or not all(v >= 0 for v in sub):
            continue  # singular or infeasible: never the best, whatever it costs
        quad = sum(sub[u] * g[i][j] * sub[v] for u, i in enumerate(idx) for v, j in enumerate(idx))
        cost = 0.5 * quad - sum(h[i] * s for i, s in zip(idx, sub, strict=True))
        if cost < best_cost:
            best, best_cost = [0.0] * k, cost
            for i, s in zip(idx, sub, strict=True):
                best[i] = s
    return best
