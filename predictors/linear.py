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

import contextlib
import math
from collections.abc import Sequence
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


# scipy.optimize.least_squares' convex robust losses: for z = (r / f)^2, rho(z), rho'(z) (the gradient
# weight) and the curvature weight of the Hessian in r, rho' + 2 z rho'' (for huber rho' itself, a
# majorant, since its exact curvature vanishes beyond f). Non-convex losses go to least_squares.
def _soft_l1(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = np.sqrt(1.0 + z)
    inv = 1.0 / s
    return 2.0 * (s - 1.0), inv, inv * inv * inv


def _huber(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = 1.0 / np.sqrt(np.maximum(z, 1.0))
    return np.where(z <= 1.0, z, 2.0 * np.sqrt(z) - 1.0), w, w


def _linear(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ones = np.ones_like(z)
    return z, ones, ones


_LOSSES = {"linear": _linear, "soft_l1": _soft_l1, "huber": _huber}
_NEWTON_MAX_ITER = 100
_NEWTON_RTOL = 1e-10  # relative size of the last step that ends the iteration
# k -> (support sets of the k coefficients in mask order, the proper ones only, each as an index
# array; and per size, the rows of those sets and their index arrays stacked for one batched solve)
_SUBSETS: dict[int, tuple[list[np.ndarray], dict[int, tuple[list[int], np.ndarray]]]] = {}


def _subsets(k: int) -> tuple[list[np.ndarray], dict[int, tuple[list[int], np.ndarray]]]:
    if k not in _SUBSETS:
        # the full set is left out: its solution is the unconstrained one _nnls has just rejected
        sets = [np.flatnonzero([(m >> i) & 1 for i in range(k)]) for m in range(1, (1 << k) - 1)]
        by_size: dict[int, tuple[list[int], np.ndarray]] = {}
        for size in sorted({len(s) for s in sets}):
            rows = [j for j, s in enumerate(sets) if len(s) == size]
            by_size[size] = (rows, np.array([sets[j] for j in rows]))
        _SUBSETS[k] = (sets, by_size)
    return _SUBSETS[k]


def _subset_solutions(g: np.ndarray, h: np.ndarray) -> list[np.ndarray | None]:
    """np.linalg.solve(G restricted to each proper support set, h restricted to it), in mask
    order (None where singular). The sets of one size are solved as one stack: LAPACK solves each
    matrix of a stack exactly as it would alone, and one call costs what a single solve does."""
    sets, by_size = _subsets(len(h))
    out: list[np.ndarray | None] = [None] * len(sets)
    for rows, idx in by_size.values():
        try:
            subs = np.linalg.solve(g[idx[:, :, None], idx[:, None, :]], h[idx][:, :, None])
            for j, sub in zip(rows, subs, strict=True):
                out[j] = sub[:, 0]
        except np.linalg.LinAlgError:  # one singular matrix fails the stack: solve them one by one
            for j in rows:
                with contextlib.suppress(np.linalg.LinAlgError):
                    out[j] = np.linalg.solve(g[np.ix_(sets[j], sets[j])], h[sets[j]])
    return out


def _nnls(g: np.ndarray, h: np.ndarray) -> np.ndarray:
    """argmin_{p >= 0} p'Gp/2 - h'p (G positive definite, a few coefficients): the unconstrained
    solution when it is non-negative, else the best over every support set (exact for small k)."""
    k = len(h)
    try:
        p = np.linalg.solve(g, h)
        if p.min() >= 0:  # (p >= 0).all() in one call; False with a NaN too
            return p
    except np.linalg.LinAlgError:
        pass
    sets = _subsets(k)[0]
    best, best_cost = np.zeros(k), 0.0  # p = 0 costs 0
    for idx, sub in zip(sets, _subset_solutions(g, h), strict=True):
        if sub is None or not sub.min() >= 0:
            continue  # singular or infeasible: never the best, whatever it costs
        g_sub = g[np.ix_(idx, idx)]
        cost = float(0.5 * sub @ g_sub @ sub - h[idx] @ sub)
        if cost < best_cost:
            best, best_cost = np.zeros(k), cost
            best[idx] = sub
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
    steps with a finite-difference Jacobian: refits run on every 32nd observation."""
    terms = _LOSSES[opts.loss]
    inv_f2 = 1.0 / (opts.f_scale * opts.f_scale)
    k = a.shape[1]
    outer = (a[:, :, None] * a[:, None, :]).reshape(len(a), k * k)  # Hessian = curvature @ outer
    r = a @ p - b
    rho, gw, cw = terms(r * r * inv_f2)
    cost = float(rho.sum())
    p_max = _absmax(p)  # carried from one iteration's end to the next's start
    for _ in range(_NEWTON_MAX_ITER):
        hess = (cw @ outer).reshape(k, k)
        step = _nnls(hess, hess @ p - (gw * r) @ a) - p
        size = _absmax(step)
        if size <= _NEWTON_RTOL * max(p_max, 1e-300):
            return p + step
        t = 1.0
        while True:  # backtrack until the cost does not rise (the step is a descent direction)
            new = p + step if t == 1.0 else p + t * step  # 1.0 * step is step, bit for bit
            r_new = a @ new - b
            terms_new = terms(r_new * r_new * inv_f2)
            new_cost = float(terms_new[0].sum())
            if new_cost <= cost or t < 1e-6:
                break
            t *= 0.5
        p, r, cost = new, r_new, new_cost
        _, gw, cw = terms_new
        p_max = _absmax(p)
        if t * size <= _NEWTON_RTOL * max(p_max, 1e-300):
            break
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
