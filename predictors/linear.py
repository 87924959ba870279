"""Robust fitting of the small linear-in-parameters models every predictor here uses.

All of Conductor's latency models are linear in their coefficients (t = sum c_i * f_i(x)) with
physically non-negative coefficients, so one fitting routine serves them all:

* residuals are *relative* ((pred - actual) / actual): latencies span two orders of magnitude and
  the error we report and care about is a percentage (MAPE), so a 10 ms miss on a 50 ms prefill
  should weigh what a 100 ms miss on a 500 ms one does;
* `scipy.optimize.least_squares` with a robust loss (soft_l1 by default) bounds the pull of any
  single bad sample, and a second pass drops samples whose log-ratio to the first fit lies beyond
  k * MAD (scaled to a standard deviation) before refitting;
* an optional prior (the previous coefficients) enters as pseudo-residuals with a small weight, so a
  direction the window does not excite (say, every sample had cached_tokens = 0) keeps its prior
  value instead of wandering;
* the p90 upper bound is multiplicative: the 90th percentile of actual / predicted over the inliers.

Prediction itself (`LinearModel.predict`) is plain float arithmetic: it runs on the request path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass(frozen=True, slots=True)
class LinearModel:
    """y = sum(coef[i] * features[i]); the feature map belongs to the predictor that owns it."""

    coef: tuple[float, ...]  # fitted coefficients, all >= 0 (seconds per unit of each feature)
    p90_ratio: float = 1.0  # 90th percentile of actual/predicted: p90 upper bound = predicted * this
    samples: int = 0  # samples the last fit used (inliers), 0 for a prior never fitted to data
    mape: float = 0.0  # mean absolute percentage error of the last fit on its inliers (0..1)

    def predict(self, features: Sequence[float]) -> float:
        return sum(c * f for c, f in zip(self.coef, features, strict=True))

    def to_dict(self) -> dict[str, object]:
        return {
            "coef": list(self.coef),
            "p90_ratio": self.p90_ratio,
            "samples": self.samples,
            "mape": self.mape,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> LinearModel:
        coef = data["coef"]
        if not isinstance(coef, list) or not all(isinstance(c, int | float) for c in coef):
            raise ValueError(f"model coefficients must be a list of numbers, got {coef!r}")
        return cls(
            coef=tuple(float(c) for c in coef),
            p90_ratio=float(data.get("p90_ratio", 1.0)),  # type: ignore[arg-type]
            samples=int(data.get("samples", 0)),  # type: ignore[call-overload]
            mape=float(data.get("mape", 0.0)),  # type: ignore[arg-type]
        )


@dataclass(frozen=True, slots=True)
class FitOptions:
    """How a fit treats noise."""

    loss: str = "soft_l1"  # any least_squares loss: "soft_l1", "huber", "cauchy", "linear"
    f_scale: float = 0.05  # relative residual where the robust loss turns from quadratic to linear
    mad_k: float = 4.0  # drop samples whose log(actual/pred) is beyond mad_k sigma of the median
    prior_weight: float = 0.0  # total weight of the prior pseudo-residuals (0: no prior)


# scipy.optimize.least_squares' convex robust losses of z = (r / f)^2, in two parts: the cost
# sum(rho(z)) up to a constant and a positive factor (all a line search compares), with what the
# weights need of it; and the weights, rho'(z) (the gradient's) and the curvature weight of the
# Hessian in r, rho' + 2 z rho'' (for huber rho' itself, a majorant, since its exact curvature
# vanishes beyond f). Non-convex losses go to least_squares.
def _soft_l1_cost(z: np.ndarray) -> tuple[float, np.ndarray]:
    s = np.sqrt(1.0 + z)  # rho = 2 (s - 1): the sum of s orders the costs the same
    return float(s.sum()), s


def _soft_l1_weights(z: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / s
    return inv, inv * inv * inv


def _huber_cost(z: np.ndarray) -> tuple[float, np.ndarray]:
    return float(np.where(z <= 1.0, z, 2.0 * np.sqrt(z) - 1.0).sum()), z


def _huber_weights(z: np.ndarray, _: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = 1.0 / np.sqrt(np.maximum(z, 1.0))
    return w, w


def _linear_cost(z: np.ndarray) -> tuple[float, np.ndarray]:
    return float(z.sum()), z


def _linear_weights(z: np.ndarray, _: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ones = np.ones_like(z)
    return ones, ones


_Cost = Callable[[np.ndarray], tuple[float, np.ndarray]]
_Weights = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
_LOSSES: dict[str, tuple[_Cost, _Weights]] = {
    "linear": (_linear_cost, _linear_weights),
    "soft_l1": (_soft_l1_cost, _soft_l1_weights),
    "huber": (_huber_cost, _huber_weights),
}
_NEWTON_MAX_ITER = 100
_NEWTON_RTOL = 1e-10  # relative size of the last step that ends the iteration
_SUBSETS: dict[int, list[list[int]]] = {}  # k -> the proper, non-empty support sets of k coefficients


def _subsets(k: int) -> list[list[int]]:
    if k not in _SUBSETS:
        # the full set is left out: its solution is the unconstrained one _nnls has just rejected
        _SUBSETS[k] = [[i for i in range(k) if (m >> i) & 1] for m in range(1, (1 << k) - 1)]
    return _SUBSETS[k]


def _lin_solve(g: list[list[float]], h: list[float]) -> list[float] | None:
    """G p = h for a few unknowns, in Python floats: Gaussian elimination with partial pivoting
    (LAPACK's gesv does the same on these sizes; numpy's call costs ten times the arithmetic).
    None when a pivot is exactly zero (where gesv reports a singular matrix)."""
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
            if f:
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


def _nnls(g: list[list[float]], h: list[float]) -> list[float]:
    """argmin_{p >= 0} p'Gp/2 - h'p (G positive definite, a few coefficients): the unconstrained
    solution when it is non-negative, else the best over every support set (exact for small k)."""
    p = _lin_solve(g, h)
    if p is not None and all(v >= 0 for v in p):  # False with a NaN too
        return p
    k = len(h)
    best, best_cost = [0.0] * k, 0.0  # p = 0 costs 0
    for idx in _subsets(k):
        sub = _lin_solve([[g[i][j] for j in idx] for i in idx], [h[i] for i in idx])
        if sub is None or not all(v >= 0 for v in sub):
            continue  # singular or infeasible: never the best, whatever it costs
        quad = sum(sub[u] * g[i][j] * sub[v] for u, i in enumerate(idx) for v, j in enumerate(idx))
        cost = 0.5 * quad - sum(h[i] * s for i, s in zip(idx, sub, strict=True))
        if cost < best_cost:
            best, best_cost = [0.0] * k, cost
            for i, s in zip(idx, sub, strict=True):
                best[i] = s
    return best


def _absmax(v: np.ndarray) -> float:
    """float(np.abs(v).max()) of a few coefficients, in Python floats (the same maximum, NaN
    included): the two numpy calls cost more than the comparisons for k of 2 or 3."""
    vals = v.tolist()
    if any(x != x for x in vals):
        return math.nan
    return max(map(abs, vals))


def _newton(a: np.ndarray, b: np.ndarray, p: np.ndarray, opts: FitOptions) -> np.ndarray:
    """min sum(rho(((a @ p - b) / f)^2)) over p >= 0: projected Newton steps with backtracking.

    The same minimum `least_squares(..., bounds=(0, inf), loss=...)` converges to (the losses here
    are convex), to within its tolerances (~1e-8), in a few k x k solves instead of trust-region
    steps with a finite-difference Jacobian: refits run on every 32nd observation. The k x k
    systems are solved in Python floats (_nnls), and the weights are computed only for a point
    the line search accepts."""
    cost_of, weights_of = _LOSSES[opts.loss]
    inv_f = 1.0 / opts.f_scale
    a = a * inv_f  # residuals in units of f: z = r * r
    b = b * inv_f
    at = np.ascontiguousarray(a.T)  # Hessian = (at * curvature) @ a
    r = a @ p - b
    z = r * r
    cost, state = cost_of(z)
    gw, cw = weights_of(z, state)
    p_max = _absmax(p)  # carried from one iteration's end to the next's start
    for _ in range(_NEWTON_MAX_ITER):
        hess = (at * cw) @ a
        target = np.array(_nnls(hess.tolist(), (hess @ p - (gw * r) @ a).tolist()))
        step = target - p
        size = _absmax(step)
        if size <= _NEWTON_RTOL * max(p_max, 1e-300):
            return target
        t = 1.0
        while True:  # backtrack until the cost does not rise (the step is a descent direction)
            new = target if t == 1.0 else p + t * step
            r_new = a @ new - b
            z = r_new * r_new
            new_cost, state = cost_of(z)
            if new_cost <= cost or t < 1e-6:
                break
            t *= 0.5
        p, r, cost = new, r_new, new_cost
        p_max = _absmax(p)
        if t * size <= _NEWTON_RTOL * max(p_max, 1e-300):
            break
        gw, cw = weights_of(z, state)
    return p


def _solve(x: np.ndarray, y: np.ndarray, start: np.ndarray, prior: np.ndarray | None, opts: FitOptions) -> np.ndarray:
    # scale columns so the solver sees coefficients of order one (c2 of a quadratic is ~1e-8)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    p_start = np.maximum(start * scale, 1e-12)
    if prior is not None and opts.prior_weight > 0:
        p_prior = prior * scale
        # relative to each coefficient's own size, but a zero prior coefficient must not pin its
        # coefficient at zero forever: floor the scale at 1% of the model's total contribution
        denom = np.maximum(np.abs(p_prior), 0.01 * max(float(np.abs(p_prior).sum()), 1e-12))
        w = np.sqrt(opts.prior_weight / len(p_prior))
    else:
        p_prior = None

    if opts.loss in _LOSSES:
        # the residuals below as one linear system: relative errors (x p - y) / y, then the prior
        a, b = xs / y[:, None], np.ones(len(y))
        if p_prior is not None:
            a = np.vstack([a, np.diag(w / denom)])
            b = np.concatenate([b, w * p_prior / denom])
        return np.asarray(_newton(a, b, p_start, opts) / scale)

    def residuals(p: np.ndarray) -> np.ndarray:
        r = (xs @ p - y) / y
        if p_prior is None:
            return r
        return np.concatenate([r, w * (p - p_prior) / denom])

    sol = least_squares(residuals, p_start, bounds=(0.0, np.inf), loss=opts.loss, f_scale=opts.f_scale)
    return np.asarray(sol.x / scale)


def _median(v: np.ndarray) -> float:
    """float(np.median(v)) of a finite 1-D array, from a partition around its middle (the
    median's bookkeeping cost more than the partition): the same order statistics, and for an
    even count their sum halved, as np.median's mean of the two computes it."""
    n = len(v)
    k = n // 2
    if n % 2:
        return float(np.partition(v, k)[k])
    part = np.partition(v, (k - 1, k))
    return (float(part[k - 1]) + float(part[k])) / 2


def _quantile(v: np.ndarray, q: float) -> float:
    """float(np.quantile(v, q)) of a finite 1-D array (its default "linear" method), from a
    partition: the two order statistics around (n - 1) * q, interpolated as numpy's _lerp does
    (from the nearer one, so the result is bit for bit numpy's)."""
    n = len(v)
    pos = (n - 1) * q
    lo = math.floor(pos)
    if lo >= n - 1:
        return float(np.max(v))
    part = np.partition(v, (lo, lo + 1))
    a, b = float(part[lo]), float(part[lo + 1])
    t = pos - lo
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def fit_linear(
    features: Sequence[Sequence[float]] | np.ndarray,
    actual: Sequence[float] | np.ndarray,
    *,
    start: Sequence[float] | None = None,
    prior: Sequence[float] | None = None,
    options: FitOptions = FitOptions(),
) -> LinearModel:
    """Fit non-negative coefficients to (features, actual) robustly; see the module docstring."""
    x = np.asarray(features, dtype=float)
    y = np.asarray(actual, dtype=float)
    if x.ndim != 2 or len(x) != len(y) or len(y) == 0:
        raise ValueError(f"need a 2-D feature matrix matching {len(y)} positive actuals")
    keep = np.isfinite(y) & (y > 0) & np.isfinite(x).all(axis=1)
    if not keep.all():  # a refit's window is nearly always clean: copy only when not
        x, y = x[keep], y[keep]
    if len(y) == 0:
        raise ValueError("no finite positive samples to fit")
    pri = None if prior is None else np.asarray(prior, dtype=float)
    p0 = np.asarray(start if start is not None else (prior if prior is not None else np.ones(x.shape[1])), float)
    coef = _solve(x, y, p0, pri, options)
    # second pass: reject gross outliers by the MAD of log-ratios, then refit on the rest
    pred = None  # the first fit's predictions, kept while they are the final ones
    x_in, y_in = x, y
    if len(y) >= 8 and options.mad_k > 0:
        pred = np.maximum(x @ coef, 1e-12)
        lr = np.log(y / pred)
        med = _median(lr)
        mad = _median(np.abs(lr - med)) * MAD_TO_SIGMA
        if mad > 0:
            inliers = np.abs(lr - med) <= options.mad_k * mad
            n_in = int(inliers.sum())
            if n_in < len(y):
                x_in, y_in = x[inliers], y[inliers]
                pred = None
                if n_in >= x.shape[1]:
                    coef = _solve(x_in, y_in, coef, pri, options)
    if pred is None:
        pred = np.maximum(x_in @ coef, 1e-12)
    ratio = y_in / pred
    return LinearModel(
        coef=tuple(float(c) for c in coef),
        p90_ratio=_quantile(ratio, 0.9),
        samples=len(y_in),
        mape=float(np.mean(np.abs(pred - y_in) / y_in)),
    )
