"""How the predictors' models learn online: each model's window of samples, when it is refitted,
and the refit itself (predictors.online.Predictors decides what a sample is and what a refit
changes).

Every model keeps a sliding window of (features, actual) samples and is refitted on it every
`refit_every` new samples (robust loss, MAD rejection, previous coefficients as a weak prior, see
predictors.linear). A young window is also refitted each time it doubles from `min_samples`, so a
model that starts far off is corrected early; a full window whose refits change nothing backs its
interval off up to `refit_max_every`, and a refit that moves the model brings it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from predictors.linear import FitOptions, LinearModel, fit_linear


@dataclass(frozen=True, slots=True)
class OnlineConfig:
    """How the models learn from observations."""

    enabled: bool = True
    window: int = 512  # samples kept per model (a sliding window: old behaviour ages out)
    refit_every: int = 32  # refit after this many new samples (a fit costs ~0.3 ms)
    # the mixed leg model's interval (Predictors.observe_mixed_leg): its seven coefficients describe
    # how streams and resident KV stretch a prefill, which moves with the load, and a leg predicted
    # at decision time is observed a queue later; every 8 instead of 32: the gateway's mixed TTFT
    # MAPE over four seeds 14.0% -> 12.5% (docs/kvcache_aware.md, "Learning")
    mixed_refit_every: int = 8
    # the mixed leg model's predictions are scaled by the median actual / predicted of its newest
    # this many legs (Predictors.mixed_scale; 0: off): a refit weighs its whole window alike, so a
    # load surge shows in the newest legs several refits before the fit follows. The gateway's mixed
    # TTFT MAPE over four seeds: 11.9% off, 10.0% at 16, 9.1% at 8 (docs/kvcache_aware.md, "Learning")
    mixed_recent: int = 8
    # while refits leave a model's predictions where they were (within refit_stable_move on every
    # sample of its window) and the model fits its window (median actual/predicted within
    # refit_stable_move of 1), the interval doubles up to this; a refit that moves a prediction
    # by refit_reset_move or more brings it back to refit_every (Refitter._adapt_interval)
    refit_max_every: int = 256
    refit_stable_move: float = 0.01
    refit_reset_move: float = 0.05
    # do not refit on fewer samples than this; while the window holds fewer than refit_every, a
    # refit also comes each time it doubles from here (8, 16): a model that starts far off (the
    # bundled profile against slower workers) is corrected after 8 requests, not 32
    min_samples: int = 8
    prior_weight: float = 1.0  # weight of the previous coefficients in a refit
    loss: str = "soft_l1"
    f_scale: float = 0.05
    mad_k: float = 4.0
    error_window: int = 256  # records per (component, instance) in the error tracker
    error_max_keys: int = 1024
    ratio_window: int = 256  # actual/predicted ratios kept per quantity for calibrated bounds
    # the TTFT bound's window is shifted by this many seconds (predictors.quantile): 0 takes every
    # error as proportional to the prediction
    ttft_bound_shift_s: float = 0.0
    # keep the per-instance error windows (`error_stats`, the gateway's Prometheus export). They
    # feed no prediction: a simulation, which never reads them, turns them off (traces/sim/runner.py)
    track_errors: bool = True


class SampleWindow:
    """A model's sliding window of (features, actual), in preallocated arrays that a refit reads
    as they are (rows in ring order: a fit does not depend on the order of its samples)."""

    __slots__ = ("base_every", "every", "fresh", "head", "n", "x", "y")

    def __init__(self, size: int, every: int = 32) -> None:
        self.x: np.ndarray | None = None  # (size, features), allocated on the first sample
        self.y = np.empty(max(1, size))
        self.n = 0  # samples held
        self.head = 0  # where the next one goes
        self.fresh = 0  # samples since the last refit
        self.every = every  # new samples that make the next refit (Refitter adapts it)
        self.base_every = every  # where a refit that moved the model brings `every` back

    def append(self, features: Sequence[float], actual: float) -> None:
        size = len(self.y)
        if self.x is None:
            self.x = np.empty((size, len(features)))
        self.x[self.head] = features
        self.y[self.head] = actual
        self.head = (self.head + 1) % size
        self.n = min(self.n + 1, size)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        assert self.x is not None
        return self.x[: self.n], self.y[: self.n]

    def recent_ratio(self, coef: Sequence[float], k: int) -> float | None:
        """The median actual / predicted (by `coef`) over the newest `k` samples; None while fewer
        than `k` have a positive prediction."""
        if self.x is None or self.n < k:
            return None
        rows = (self.head - 1 - np.arange(k)) % len(self.y)
        predicted = self.x[rows] @ np.asarray(coef)
        positive = predicted > 0
        if int(positive.sum()) < k:
            return None
        return float(np.median(self.y[rows] / predicted))


class Refitter:
    """The refit schedule and the fits of one Predictors' windows, and how many fits it made."""

    __slots__ = ("moved", "online", "refits")

    def __init__(self, online: OnlineConfig) -> None:
        self.online = online
        self.refits = 0
        # the last refit's move: the median relative change of the model's predictions over its
        # window's own samples (where the model is used: the predictions its ratio windows measured)
        self.moved = 0.0

    def window(self, every: int | None = None) -> SampleWindow:
        """A model's window, refitted every `every` new samples (`refit_every` when None)."""
        return SampleWindow(self.online.window, every or self.online.refit_every)

    def add(self, win: SampleWindow, features: tuple[float, ...], actual: float) -> bool:
        """Append a sample; True when it is time to refit."""
        if not self.online.enabled:
            return False
        win.append(features, actual)
        win.fresh += 1
        first = self.online.min_samples
        n = win.n
        if n < first:
            return False
        # young window: also at first, 2 x first, 4 x first ... below the window's own interval
        k = n // first
        young = n < win.base_every and n == k * first and k & (k - 1) == 0
        if win.fresh >= win.every or young:
            win.fresh = 0
            return True
        return False

    def refit(self, win: SampleWindow, current: LinearModel, prior_scale: float = 1.0) -> LinearModel | None:
        """`current` refitted on its window, None when the window cannot be fitted (the model
        then stays as it is). `prior_scale` scales the prior's weight (a model's own choice)."""
        o = self.online
        opts = FitOptions(loss=o.loss, f_scale=o.f_scale, mad_k=o.mad_k, prior_weight=o.prior_weight * prior_scale)
        try:
            x, y = win.arrays()
            fitted = fit_linear(x, y, prior=current.coef, options=opts)
        except ValueError:
            return None
        self.refits += 1
        self._adapt_interval(win, x, y, current, fitted)
        return fitted

    def _adapt_interval(self, win: SampleWindow, x: np.ndarray, y: np.ndarray, current: LinearModel, fitted: LinearModel) -> None:
        """Back a window's refits off while they change nothing; back to the window's own interval
        (`base_every`) on a change.

        The move is the largest relative change of the model's prediction over the window's own
        samples (one point would hide a trade between the constant and the slope). Steady also
        needs the new fit to sit on its samples (median actual/predicted near 1): a model the prior
        still holds back from a shifted truth moves by little at each refit and must go on. And a
        full window: while it fills, every refit has more to learn from than the last."""
        o = self.online
        new = np.maximum(x @ np.asarray(fitted.coef), 1e-12)
        moves = np.abs(new / np.maximum(x @ np.asarray(current.coef), 1e-12) - 1.0)
        move = float(np.max(moves))
        self.moved = float(np.median(moves))
        if win.n == len(win.y) and move < o.refit_stable_move and abs(float(np.median(y / new)) - 1.0) < o.refit_stable_move:
            win.every = min(2 * win.every, max(win.base_every, o.refit_max_every))
        elif move >= o.refit_reset_move:
            win.every = win.base_every
