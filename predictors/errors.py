"""How wrong the predictors are, per component and instance, over a bounded recent window.

Each record is (predicted, predicted p90 upper bound, actual). The tracker keeps the last `window`
records for each (component, instance) key and at most `max_keys` keys, evicting the least recently
updated key (instances come and go; memory must not). `stats()` returns plain frozen data that the
gateway exports to Prometheus and the simulator prints.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Prediction error of one component on one instance over the recent window."""

    component: str  # "prefill", "queue_and_prefill", "ttft", "tbt", "transfer"
    instance: str  # instance id ("" when the component is cluster-wide)
    samples: int  # records in the window
    mape: float  # mean |pred - actual| / actual, 0..inf
    p90_coverage: float  # fraction of actuals <= the predicted p90 upper bound (ideal: 0.9)
    bias: float  # median actual / predicted (1.0: unbiased; > 1: the model predicts too little)


@dataclass(slots=True)
class _Window:
    records: deque[tuple[float, float, float]]


class ErrorTracker:
    """Bounded windows of (predicted, p90, actual) keyed by (component, instance)."""

    def __init__(self, window: int = 256, max_keys: int = 1024) -> None:
        if window < 1 or max_keys < 1:
            raise ValueError("window and max_keys must be positive")
        self._window = window
        self._max_keys = max_keys
        self._keys: OrderedDict[tuple[str, str], _Window] = OrderedDict()

    def record(self, component: str, instance: str, predicted: float, p90: float, actual: float) -> None:
        if not (predicted > 0 and actual > 0):  # nothing meaningful to compare (or NaN)
            return
        key = (component, instance)
        win = self._keys.get(key)
        if win is None:
            win = _Window(deque(maxlen=self._window))
            self._keys[key] = win
            while len(self._keys) > self._max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        win.records.append((predicted, p90, actual))

    def stats(self) -> tuple[ErrorStats, ...]:
        out = []
        for (component, instance), win in self._keys.items():
            recs = win.records
            n = len(recs)
            if n == 0:
                continue
            mape = sum(abs(p - a) / a for p, _, a in recs) / n
            covered = sum(1 for _, hi, a in recs if a <= hi) / n
            ratios = sorted(a / p for p, _, a in recs)
            mid = n // 2
            bias = ratios[mid] if n % 2 else (ratios[mid - 1] + ratios[mid]) / 2
            out.append(ErrorStats(component, instance, n, mape, covered, bias))
        return tuple(out)

    def __len__(self) -> int:
        return len(self._keys)
