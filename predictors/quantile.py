"""Calibrated upper bounds: empirical quantiles of actual / predicted over a recent window.

A fitted model's own p90 ratio (predictors.linear) describes one component on its fitting window.
The figure admission compares with an SLO is a sum of components (queue, prefill, KV handoff,
first decode step, HTTP), each with its own error, and the sum's spread depends on how the error
terms add up under the current load. Rather than composing those analytically, the policy
measures it: every observed TTFT (and prefill leg, and TBT) is divided by what was predicted for
it at decision time, and the q-quantile of the recent ratios times a new point prediction is the
q upper bound. It is calibrated by construction for the load the window saw -- coverage of the
p90 bound is 0.9 on the next requests as long as the regime does not change faster than the
window turns over -- and it moves with the regime (under overload the window fills with requests
admitted behind long queues, whose relative error is smaller).

Ratios describe the model that made the predictions. When a refit moves a model's predictions by
more than `Predictors.RATIO_RESET`, the windows measuring that model are cleared (see predictors.online):
the bound falls back to the fit's own p90 ratio until `min_samples` ratios of the new model exist,
rather than calibrating a model with another model's errors (2x off after a time-scale change).

A window may be *shifted*: it keeps (actual + shift) / (predicted + shift) and its bound of a new
prediction p is (p + shift) * quantile - shift. Shift 0 is the plain ratio: every error is taken to
scale with the prediction. An error that adds a fixed delay whatever the prediction -- one prefill
queued ahead that the decision did not see, as when several gateway replicas dispatch in the same
few milliseconds -- shows as a large ratio on small predictions, and a plain ratio carries it as a
multiple onto long ones (a 0.1 s prediction that took 0.4 s makes a 2 s prediction's bound 8 s).
With a shift, an error is taken as additive for predictions well below the shift and as
proportional well above it: a shift of the order of the TTFT SLO makes the bounds admission
compares with the SLO (predictions below it) close to prediction + the delays seen.

Memory is bounded: `window` ratios per key, at most `max_keys` keys (component names, a handful).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping


class RatioWindow:
    """Recent actual/predicted ratios of one quantity, and their empirical quantiles."""

    def __init__(self, window: int = 256, min_samples: int = 20, shift: float = 0.0) -> None:
        if window < 1:
            raise ValueError("window must be positive")
        if not (shift >= 0 and math.isfinite(shift)):
            raise ValueError("shift must be a finite number >= 0")
        self.shift = shift
        self._ratios: deque[float] = deque(maxlen=window)
        # the same ratios kept sorted as they come and go (a quantile is asked for on every
        # decision and a ratio added on every observation: re-sorting each time dominated)
        self._sorted: list[float] = []
        self.min_samples = min_samples
        # q -> quantile of the ratios held now (a decision asks for the same few q many times
        # between two additions); emptied by every addition
        self._quantiles: dict[float, float] = {}

    def add(self, predicted: float, actual: float) -> None:
        if predicted > 0 and actual > 0 and math.isfinite(predicted) and math.isfinite(actual):
            ratios, s = self._ratios, self._sorted
            if len(ratios) == ratios.maxlen:
                del s[bisect_left(s, ratios[0])]  # the oldest leaves the window with this append
            ratio = (actual + self.shift) / (predicted + self.shift)
            ratios.append(ratio)
            insort(s, ratio)
            self._quantiles.clear()

    def __len__(self) -> int:
        return len(self._ratios)

    def quantile(self, q: float, default: float) -> float:
        """The q-quantile of the ratios (linear interpolation), or `default` while too few."""
        n = len(self._ratios)
        if n < self.min_samples:
            return default
        value = self._quantiles.get(q)
        if value is None:
            s = self._sorted
            pos = min(max(q, 0.0), 1.0) * (n - 1)
            lo = int(pos)
            hi = min(lo + 1, n - 1)
            value = self._quantiles[q] = s[lo] + (s[hi] - s[lo]) * (pos - lo)
        return value

    def bound(self, predicted: float, q: float, default_ratio: float) -> float:
        """The q upper bound of `predicted`: (predicted + shift) * q-quantile - shift, never below
        0; `predicted * default_ratio` while too few ratios are held."""
        if len(self._ratios) < self.min_samples:
            return predicted * default_ratio
        return max(0.0, (predicted + self.shift) * self.quantile(q, 1.0) - self.shift)

    def largest_within(self, limit: float, q: float, default_ratio: float) -> float:
        """The largest prediction whose `bound(prediction, q, default_ratio)` is at most `limit`
        (bound's inverse; 0.0 when even a prediction of 0 is bounded above it, inf when every
        one fits). A policy that wants the bound under a limit compares its point predictions
        with this one number instead of bounding each."""
        if limit < 0:
            return 0.0
        if len(self._ratios) < self.min_samples:
            return limit / default_ratio if default_ratio > 0 else math.inf
        ratio = self.quantile(q, 1.0)
        if ratio <= 0:
            return math.inf
        return max(0.0, (limit + self.shift) / ratio - self.shift)


class RatioWindows:
    """RatioWindow per named quantity ("ttft", "queue_and_prefill", "tbt_at_decision"); `shifts`
    names the quantities whose windows are shifted, and by how much (seconds)."""

    def __init__(
        self, window: int = 256, min_samples: int = 20, max_keys: int = 16, shifts: Mapping[str, float] | None = None
    ) -> None:
        self._window = window
        self._shifts = dict(shifts or {})
        self._min = min_samples
        self._max_keys = max(1, max_keys)
        self._by_key: OrderedDict[str, RatioWindow] = OrderedDict()

    def add(self, key: str, predicted: float, actual: float) -> None:
        win = self._by_key.get(key)
        if win is None:
            win = self._by_key[key] = RatioWindow(self._window, self._min, self._shifts.get(key, 0.0))
            while len(self._by_key) > self._max_keys:
                self._by_key.popitem(last=False)
        win.add(predicted, actual)

    def quantile(self, key: str, q: float, default: float) -> float:
        win = self._by_key.get(key)
        return default if win is None else win.quantile(q, default)

    def bound(self, key: str, predicted: float, q: float, default_ratio: float) -> float:
        """The q upper bound of a prediction of `key` (RatioWindow.bound)."""
        win = self._by_key.get(key)
        return predicted * default_ratio if win is None else win.bound(predicted, q, default_ratio)

    def largest_within(self, key: str, limit: float, q: float, default_ratio: float) -> float:
        """The largest prediction of `key` bounded at most `limit` (RatioWindow.largest_within)."""
        win = self._by_key.get(key)
        if win is None:
            return max(0.0, limit) / default_ratio if default_ratio > 0 else math.inf
        return win.largest_within(limit, q, default_ratio)

    def clear(self, keys: Iterable[str] | None = None) -> None:
        """Forget the ratios of `keys` (None: of every quantity): they measured a model that has
        since been replaced."""
        if keys is None:
            self._by_key.clear()
            return
        for key in keys:
            self._by_key.pop(key, None)

    def samples(self, key: str) -> int:
        win = self._by_key.get(key)
        return 0 if win is None else len(win)
