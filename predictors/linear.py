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

from predictors.small_solve import nnls

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
# relative size of the last step that ends the iteration: the solve after a step this small is
# within ~1e-7 of the minimum, far inside any sample noise (1e-10 took 3.7 k x k solves a fit, this 3.1)
_NEWTON_RTOL = 1e-7


def _absmax(vals: list[float]) -> float:
    """float(np.abs(v).max()) of a few coefficients given as floats (the same maximum, NaN
    included): numpy's calls cost more than the comparisons for k of 2 or 3."""
    for x in vals:
        if x != x:
            return math.nan
    return max(map(abs, vals))


def _newton(a: np.ndarray, b: np.ndarray, p: np.ndarray, opts: FitOptions) -> np.ndarray:
    """min sum(rho((a @ p - b)^2)) over p >= 0 (`a` and `b` in units of f_scale, C-contiguous):
    projected Newton steps with backtracking.

    The same minimum `least_squares(..., bounds=(0, inf), loss=...)` converges to (the losses here
    are convex), to within its tolerances (~1e-8), in a few k x k solves instead of trust-region
    steps with a finite-difference Jacobian: refits run on every 32nd observation. The k x k
    systems are solved in Python floats (predictors.small_solve), the steps and their sizes too
    (elementwise float64 arithmetic is the same in numpy and Python; only the products with `a`
    stay numpy's), and the weights are computed only for a point the line search accepts."""
    cost_of, weights_of = _LOSSES[opts.loss]
    at = np.ascontiguousarray(a.T)  # Hessian = (at * curvature) @ a
    r = a @ p - b
    z = r * r
    cost, state = cost_of(z)
    gw, cw = weights_of(z, state)
    p_list = p.tolist()
    p_max = _absmax(p_list)  # carried from one iteration's end to the next's start
    for _ in range(_NEWTON_MAX_ITER):
        hess = (at * cw) @ a
        target_list = nnls(hess.tolist(), (hess @ p - (gw * r) @ a).tolist())
        target = np.array(target_list)
        step = [t - q for t, q in zip(target_list, p_list, strict=True)]
        size = _absmax(step)
        if size <= _NEWTON_RTOL * max(p_max, 1e-300):
            return target
        t = 1.0
        new, new_list = target, target_list
        while True:  # backtrack until the cost does not rise (the step is a descent direction)
            r_new = a @ new - b
            z = r_new * r_new
            new_cost, state = cost_of(z)
            if new_cost <= cost or t < 1e-6:
                break
            t *= 0.5
            new_list = [q + t * d for q, d in zip(p_list, step, strict=True)]  # p + t * step
            new = np.array(new_list)
        p, p_list, r, cost = new, new_list, r_new, new_cost
        p_max = _absmax(p_list)
        if t * size <= _NEWTON_RTOL * max(p_max, 1e-300):
            break
        gw, cw = weights_of(z, state)
    return p


def _solve(x: np.ndarray, y: np.ndarray, start: np.ndarray, prior: np.ndarray | None, opts: FitOptions) -> np.ndarray:
    # scale columns so the solver sees coefficients of order one (c2 of a quadratic is ~1e-8)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
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
        # the residuals as one linear system in units of f_scale: relative errors (x p - y) / y,
        # then the prior's rows; written in place into one array (the values of
        # vstack([x / scale / y, diag(w / denom)]) / f_scale, without the intermediate arrays)
        n, k = x.shape
        rows = n + (k if p_prior is not None else 0)
        a, b = np.empty((rows, k)), np.empty(rows)
        top = a[:n]
        np.divide(x, scale, out=top)
        np.divide(top, y[:, None], out=top)
        b[:n] = 1.0
        if p_prior is not None:
            a[n:] = np.diag(w / denom)
            b[n:] = w * p_prior / denom
        inv_f = 1.0 / opts.f_scale
        np.multiply(a, inv_f, out=a)
        np.multiply(b, inv_f, out=b)
        return np.asarray(_newton(a, b, p_start, opts) / scale)

    xs = x / scale

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
    # a refit's window is nearly always clean: three reductions tell (a finite sum of positive y
    # and of x has no inf or NaN in it), and the rows are filtered only when not
    if not (math.isfinite(float(x.sum()) + float(y.sum())) and float(y.min(initial=math.inf)) > 0):
        keep = np.isfinite(y) & (y > 0) & np.isfinite(x).all(axis=1)
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
        dev = np.abs(lr - med)
        mad = _median(dev) * MAD_TO_SIGMA
        if mad > 0:
            inliers = dev <= options.mad_k * mad
            n_in = int(np.count_nonzero(inliers))
            if n_in < len(y):
                x_in, y_in = x[inliers], y[inliers]
                pred = None
                if n_in >= x.shape[1]:
                    coef = _solve(x_in, y_in, coef, pri, options)
    if pred is None:
        pred = np.maximum(x_in @ coef, 1e-12)
    ratio = y_in / pred
    return LinearModel(
        coef=tuple(coef.tolist()),
        p90_ratio=_quantile(ratio, 0.9),
        samples=len(y_in),
        mape=float(np.mean(np.abs(pred - y_in) / y_in)),
    )
