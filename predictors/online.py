"""`Predictors`: the fitted models in use, their online refit and their error tracking.

Evaluation (`prefill_s`, `transfer_s`, `queue_s`, `tbt_s`) is float arithmetic on frozen params, cheap
enough to run for every instance on every request. Learning is split off: `observe_*` append a
sample to a bounded window per model, which is refitted on that window every `refit_every` samples
(predictors/refit.py: the windows, their schedule and the fit; OnlineConfig lives there too).
A refit swaps in a new frozen `PredictorParams`, so a decision never sees half-updated models.

One model per kind serves all instances (the cluster is homogeneous per role); errors are still
tracked per instance, so a slow instance shows up in the error stats rather than skewing the fit.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from types import MappingProxyType

from conductor.core.types import InstanceView, QueuedPrefill
from predictors.errors import ErrorStats, ErrorTracker
from predictors.lessons import Lesson, checked, teach
from predictors.linear import LinearModel
from predictors.params import (
    INSTANCE_LINK,
    NO_STRETCH,
    PredictorParams,
    prefill_features,
    tbt_features,
    transfer_features,
)
from predictors.profile import bundled_profile, fit_profiles
from predictors.quantile import RatioWindows
from predictors.refit import OnlineConfig, Refitter, SampleWindow

__all__ = ["FIRST_TOKEN_PRIOR", "OnlineConfig", "Predictors"]  # OnlineConfig: predictors/refit.py

# Decode leg (prefill answered -> first token at the client) = e0 + e1 * handoff + e2 * TBT; before
# any observation: 2 ms of HTTP, the predicted handoff, 1.5 decode steps (half a step waiting for
# the running one to end, then the step that samples the first token). e1 stays 1: the handoff's
# own cost is learned by the transfer model (see `observe_decode_leg`).
FIRST_TOKEN_PRIOR = LinearModel(coef=(0.002, 1.0, 1.5), p90_ratio=1.25)
DEFAULT_ONLINE = OnlineConfig()  # frozen: one shared default
# The ratio windows (predictors.quantile) by the models whose predictions they measure: a refit that
# moves the prefill or decode-leg model clears the TTFT side's, one that moves the TBT model the
# TBT side's. Clearing every window on every move had a TBT refit throw away the TTFT bound's
# calibration, and a prefill refit admission's TBT bound's (policies/kvcache_aware/learning.py
# names the quantities).
TTFT_RATIOS = ("ttft", "queue_and_prefill", "prefill")
TBT_RATIOS = ("tbt", "tbt_at_decision", "tbt_judged")


class Predictors:
    """Latency predictions for the scheduler, refitted online. Not thread-safe (one event loop)."""

    # a refit that moves a model's predictions by more than this (the median relative move over the
    # samples of its window, Refitter.moved) clears the actual/predicted ratio windows behind the
    # calibrated bounds (predictors.quantile)
    RATIO_RESET = 0.1
    # the mixed leg model's prior weighs this fraction of the others': its stretch terms start at 0 and
    # what they describe shows only once a worker is loaded; at full weight the prior held the first
    # 100 loaded legs at half their TTFT (bench_prediction_accuracy.py --scenario mixed)
    MIXED_PRIOR_SCALE = 0.1
    MIXED_SCALE_MAX = 2.0  # mixed_scale stays within [1 / this, this]

    def __init__(self, params: PredictorParams, online: OnlineConfig = DEFAULT_ONLINE) -> None:
        self._params = params
        self._online = online
        self._refitter = refitter = Refitter(online)
        self._prefill = refitter.window()
        self._tbt = refitter.window()
        self._transfer: dict[str, SampleWindow] = {}
        self._first = refitter.window()
        self._mixed = refitter.window(online.mixed_refit_every)
        # (m0, m1, m2, m3): what the streams sharing a mixed worker's engine add to its prefills
        # (predictors.params, "Mixed leg"); 0 until mixed legs are observed
        self.mixed_coef: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        # what the newest mixed legs ran over the mixed leg model (OnlineConfig.mixed_recent): a
        # decision on mixed workers predicts with `prefill_scaled(mixed_scale)`; 1.0 until known
        self.mixed_scale = 1.0
        self.first_token_model = FIRST_TOKEN_PRIOR
        # the decode leg as fitted: k0 + k1 * handoff bytes + k2 * TBT (k1: the P -> D link's s/byte)
        lat, per_byte = params.transfer_model(INSTANCE_LINK).coef
        e0, _, e2 = FIRST_TOKEN_PRIOR.coef
        self.decode_leg_model = LinearModel((e0 + lat, per_byte, e2), FIRST_TOKEN_PRIOR.p90_ratio)
        self.errors = ErrorTracker(online.error_window, online.error_max_keys)
        self.ratios = RatioWindows(online.ratio_window, shifts={"ttft": online.ttft_bound_shift_s})
        # bumped whenever the TTFT side's (ttft_generation) or the TBT side's (tbt_generation) ratio
        # windows are cleared: a prediction made before (its request still in flight) must not add
        # its old model's ratio to the new windows
        self.ttft_generation = 0
        self.tbt_generation = 0
        # what this process learned, kept for sibling processes (record_lessons); None: not kept
        self._lessons: deque[Lesson] | None = None
        self._errors_on = online.track_errors  # off while learning a sibling's lesson
        self._cache_params()

    @classmethod
    def from_bundled_profile(cls, online: OnlineConfig = DEFAULT_ONLINE) -> Predictors:
        return cls(fit_profiles([bundled_profile()]), online)

    @classmethod
    def from_file(cls, path: str, online: OnlineConfig = DEFAULT_ONLINE) -> Predictors:
        try:
            params = PredictorParams.load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON errors are ValueErrors
            raise ValueError(f"cannot load predictor params {path} (write them with `conductor fit`): {exc}") from exc
        return cls(params, online)

    def _cache_params(self) -> None:
        # unpack the coefficients once: prefill_s runs hundreds of times a decision
        self._pc = self._params.prefill.coef
        self._tc = self._params.tbt.coef
        self._links = {k: m.coef for k, m in self._params.transfer.items()}
        self._fc = self.first_token_model.coef

    @property
    def params(self) -> PredictorParams:
        return self._params

    @property
    def kv_bytes_per_token(self) -> float:
        return self._params.kv_bytes_per_token

    @property
    def refits(self) -> int:  # of every model, so far
        return self._refitter.refits

    @property
    def prefill_fitted(self) -> bool:
        """Refitted on this fleet's legs (or not learned): its seconds are seconds, not an order."""
        return not self._online.enabled or max(self._prefill.n, self._mixed.n) >= self._online.min_samples

    # ---- evaluation -----------------------------------------------------------------------

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        c0, c1, c2 = self._pc
        return c0 + c1 * new_tokens + c2 * new_tokens * (new_tokens + 2 * cached_tokens)

    def prefill_scaled(self, scale: float) -> Predictors:
        """A view predicting prefills `scale` times slower, for one decision behind prefills that
        overran (predictors/overrun.py). Predict only: it shares this one's windows and learning."""
        view = copy.copy(self)
        view._pc = tuple(c * scale for c in self._pc)
        view.mixed_coef = tuple(c * scale for c in self.mixed_coef)  # type: ignore[assignment]
        return view

    def prefill_p90_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.prefill_s(new_tokens, cached_tokens) * self._params.prefill.p90_ratio

    def transfer_s(self, tokens: int, link: str = INSTANCE_LINK) -> float:
        """Time to move the KV of `tokens` tokens over a link class."""
        if tokens <= 0:
            return 0.0
        coef = self._links.get(link) or self._links[INSTANCE_LINK]
        return coef[0] + coef[1] * tokens * self._params.kv_bytes_per_token

    def queue_s(self, queue: Sequence[QueuedPrefill], stretch: tuple[float, float] = NO_STRETCH) -> float:
        """Predicted time until an instance with this FCFS prefill queue starts a new prefill.
        Only what is left of the running head counts, clamped at zero (its elapsed_s may include a
        wait). `stretch`: a mixed worker's (s0, s1) (`mixed_stretch`), per prefill and per token."""
        if not queue:
            return 0.0
        c0, c1, c2 = self._pc
        if stretch is not NO_STRETCH:
            c0, c1 = c0 + stretch[0], c1 + stretch[1]
        total = 0.0
        for q in queue:
            n = q.new_tokens
            total += c0 + c1 * n + c2 * n * (n + 2 * q.cached_tokens)
        head = queue[0]
        n = head.new_tokens
        head_t = c0 + c1 * n + c2 * n * (n + 2 * head.cached_tokens)
        return total - min(head.elapsed_s, head_t)

    def mixed_stretch(self, instance: InstanceView) -> tuple[float, float]:
        """(s0, s1): the seconds per prefill and per prompt token that the streams listed on a
        mixed worker add to each of its prefills (predictors.params, "Mixed leg"); NO_STRETCH
        where none is listed or nothing was learned."""
        streams = instance.decodes
        m0, m1, m2, m3 = self.mixed_coef
        if not streams or not (m0 or m1 or m2 or m3):
            return NO_STRETCH
        resident = float(instance.resident_kv_tokens)
        n = float(len(streams))
        return (m0 * resident + m2 * n, m1 * resident + m3 * n)

    def tbt_s(self, batch: float, resident_kv_tokens: float) -> float:
        d0, d1, d2 = self._tc
        return d0 + d1 * batch + d2 * resident_kv_tokens

    def tbt_p90_s(self, batch: float, resident_kv_tokens: float) -> float:
        return self.tbt_s(batch, resident_kv_tokens) * self._params.tbt.p90_ratio

    def first_token_s(self, handoff_s: float, tbt_s: float) -> float:
        """Decode leg of a disaggregated request: prefill answered -> first token at the client.

        The KV handoff (predicted by the transfer model), then waiting for the decode batch's
        current step to end and one step with the request in it (about 1.5 steps of the predicted
        TBT on average), plus the gateway's and the worker's HTTP time. Fitted online to the
        gateway's observed TTFT minus its observed prefill leg (`observe_decode_leg`).
        """
        e0, e1, e2 = self._fc
        return e0 + e1 * handoff_s + e2 * tbt_s

    @property
    def generation(self) -> tuple[int, int]:
        """(ttft_generation, tbt_generation): what a pending prediction remembers."""
        return self.ttft_generation, self.tbt_generation

    def _default_ratio(self, quantity: str) -> float:
        """A bound's ratio while its window holds too few: the p90 ratio of the model it measures."""
        return self._params.tbt.p90_ratio if quantity in TBT_RATIOS else self._params.prefill.p90_ratio

    def bound(self, quantity: str, predicted: float, q: float) -> float:
        """Calibrated q upper bound of a prediction of `quantity` (see predictors.quantile)."""
        return self.ratios.bound(quantity, predicted, q, self._default_ratio(quantity))

    def largest_within(self, quantity: str, limit: float, q: float) -> float:
        """The largest prediction of `quantity` whose calibrated q bound (`bound`) is at most `limit`."""
        return self.ratios.largest_within(quantity, limit, q, self._default_ratio(quantity))

    # ---- learning -------------------------------------------------------------------------

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float, instance: str = "") -> None:
        """A prefill's own compute time (queueing and pulls already taken out by the caller)."""
        if seconds <= 0 or new_tokens <= 0:
            return
        if self._lessons is not None:
            self._lessons.append(("prefill", new_tokens, cached_tokens, seconds))
        if self._errors_on:
            pred = self.prefill_s(new_tokens, cached_tokens)
            self.errors.record("prefill", instance, pred, pred * self._params.prefill.p90_ratio, seconds)
        if self._refitter.add(self._prefill, prefill_features(new_tokens, cached_tokens), seconds):
            self._params = replace(self._params, prefill=self._refit(self._prefill, self._params.prefill, TTFT_RATIOS))
            self._cache_params()

    def observe_leg(self, features: Sequence[float], seconds: float) -> None:
        """A prefill leg as the sum of its FCFS queue's and its own prefill features (see
        `params.queue_features`): `seconds` = observed leg + head elapsed - predicted prefix pull."""
        if seconds <= 0 or features[0] <= 0:
            return
        if self._lessons is not None:
            self._lessons.append(("leg", *(float(f) for f in features[:3]), seconds))
        if self._refitter.add(self._prefill, tuple(float(f) for f in features), seconds):
            self._params = replace(self._params, prefill=self._refit(self._prefill, self._params.prefill, TTFT_RATIOS))
            self._cache_params()

    def observe_mixed_leg(self, features: Sequence[float], seconds: float) -> None:
        """A mixed worker's leg (its first token): `features` are params.mixed_leg_features of the
        queue's and the request's summed prefill features and the worker's streams at decision
        time, `seconds` as for `observe_leg`. One fit of the 7 coefficients: the first 3 become
        the prefill model (what a prefill costs with no stream beside it), the rest `mixed_coef`."""
        if seconds <= 0 or features[0] <= 0:
            return
        if self._lessons is not None:
            self._lessons.append(("mixed_leg", *(float(f) for f in features[:7]), seconds))
        if self._refitter.add(self._mixed, tuple(float(f) for f in features), seconds):
            prefill = self._params.prefill
            current = LinearModel((*prefill.coef, *self.mixed_coef), prefill.p90_ratio, prefill.samples, prefill.mape)
            fitted = self._refit(self._mixed, current, TTFT_RATIOS, self.MIXED_PRIOR_SCALE)
            c = fitted.coef
            self._params = replace(self._params, prefill=LinearModel(c[:3], fitted.p90_ratio, fitted.samples, fitted.mape))
            self.mixed_coef = (c[3], c[4], c[5], c[6])
            self._cache_params()
        recent = self._online.mixed_recent
        ratio = self._mixed.recent_ratio((*self._params.prefill.coef, *self.mixed_coef), recent) if recent else None
        if ratio is not None:  # bounded: a larger lag is the overrun check's (predictors/overrun.py)
            self.mixed_scale = min(self.MIXED_SCALE_MAX, max(1.0 / self.MIXED_SCALE_MAX, ratio))

    def observe_decode_leg(self, handoff_tokens: int, tbt_s: float, seconds: float) -> None:
        """Observed TTFT minus observed prefill leg of a disaggregated request whose prompt KV of
        `handoff_tokens` went P -> D, decoded at a predicted TBT of `tbt_s`.

        The leg is the handoff (link latency + bytes / bandwidth) plus the decode steps and HTTP,
        so it is fitted as k0 + k1 * bytes + k2 * TBT over a window, like every other model. k1 is
        the link's seconds per byte: it replaces the instance link's (and that of every link that
        was a copy of it, such as the store link of the bundled profile) per-byte coefficient, so
        predicted transfers -- handoffs and prefix pulls -- learn from every request; the link's
        latency stays as fitted offline (it cannot be told from k0) and k0 less it is the first-
        token model's constant."""
        if seconds <= 0 or handoff_tokens <= 0:
            return
        if self._lessons is not None:
            self._lessons.append(("decode_leg", handoff_tokens, tbt_s, seconds))
        nbytes = handoff_tokens * self._params.kv_bytes_per_token
        if not self._refitter.add(self._first, (1.0, nbytes, tbt_s), seconds):
            return
        fitted = self._refit(self._first, self.decode_leg_model, TTFT_RATIOS)
        self.decode_leg_model = fitted
        k0, k1, k2 = fitted.coef
        instance = self._params.transfer_model(INSTANCE_LINK)
        links = dict(self._params.transfer)
        for link, model in self._params.transfer.items():
            if link == INSTANCE_LINK or (model == instance and link not in self._transfer):
                links[link] = replace(model, coef=(model.coef[0], k1))
        self._params = replace(self._params, transfer=MappingProxyType(links))
        e0 = max(0.0, k0 - instance.coef[0])
        self.first_token_model = LinearModel((e0, 1.0, k2), fitted.p90_ratio, fitted.samples, fitted.mape)
        self._cache_params()

    def observe_tbt(self, batch: int, resident_kv_tokens: int, seconds: float, instance: str = "") -> None:
        """Mean time between tokens of a stream that ran with about this batch and resident KV."""
        if seconds <= 0 or batch <= 0:
            return
        if self._lessons is not None:
            self._lessons.append(("tbt", batch, resident_kv_tokens, seconds))
        pred = self.tbt_s(batch, resident_kv_tokens)
        if self._errors_on:
            # the bound from the ratios seen so far (out of sample), not the fit's in-sample p90 ratio
            hi = pred * self.ratios.quantile("tbt", 0.9, self._params.tbt.p90_ratio)
            self.errors.record("tbt", instance, pred, hi, seconds)
        self.ratios.add("tbt", pred, seconds)
        if self._refitter.add(self._tbt, tbt_features(batch, resident_kv_tokens), seconds):
            self._params = replace(self._params, tbt=self._refit(self._tbt, self._params.tbt, TBT_RATIOS))
            self._cache_params()

    def observe_transfer(self, link: str, nbytes: float, seconds: float, instance: str = "") -> None:
        if seconds <= 0 or nbytes <= 0:
            return
        if self._lessons is not None:
            self._lessons.append(("transfer", link, float(nbytes), seconds))
        model = self._params.transfer_model(link)
        if self._errors_on:
            pred = model.predict(transfer_features(nbytes))
            self.errors.record(f"transfer_{link}", instance, pred, pred * model.p90_ratio, seconds)
        win = self._transfer.get(link)
        if win is None:
            if len(self._transfer) >= 16:  # link classes are a handful; refuse to grow unbounded
                return
            win = self._transfer[link] = self._refitter.window()
        if self._refitter.add(win, transfer_features(nbytes), seconds):
            links = dict(self._params.transfer)
            links[link] = self._refit(win, model)
            self._params = replace(self._params, transfer=MappingProxyType(links))
            self._cache_params()

    @property
    def tracks_errors(self) -> bool:
        """Whether errors are recorded (OnlineConfig.track_errors): a caller that only computes a
        figure for `record_error` (a p90 bound) may skip it when not."""
        return self._online.track_errors

    def record_error(self, component: str, instance: str, predicted: float, p90: float, actual: float) -> None:
        if self._errors_on:
            self.errors.record(component, instance, predicted, p90, actual)

    def error_stats(self) -> tuple[ErrorStats, ...]:
        return self.errors.stats()

    def reset_errors(self) -> None:
        """Start the error windows afresh (e.g. after a warm-up); models and bounds are kept."""
        o = self._online
        self.errors = ErrorTracker(o.error_window, o.error_max_keys)

    # ---- lessons: learning from sibling processes (predictors/lessons.py) -------------------

    def record_lessons(self, maxlen: int = 4096) -> deque[Lesson]:
        """Keep, from now on, every sample this process's models learn, as lessons for its
        siblings, in the deque returned (the oldest dropped past `maxlen`: a sibling that falls
        behind misses lessons, nothing grows). Take them out as they come."""
        self._lessons = deque(maxlen=maxlen)
        return self._lessons

    def learn(self, raw: object) -> None:
        """Learn a sibling's lesson as if this process had made the observation: the same windows
        and refits, no error records (those are each process's own diagnostics), and nothing kept
        as a lesson of its own (no echo back). ValueError, and nothing learned, if it is malformed."""
        lesson = checked(raw)
        lessons, self._lessons = self._lessons, None
        self._errors_on = False
        try:
            teach(self, lesson)
        finally:
            self._lessons = lessons
            self._errors_on = self._online.track_errors

    def _refit(
        self, win: SampleWindow, current: LinearModel, clears: tuple[str, ...] = (), prior_scale: float = 1.0
    ) -> LinearModel:
        """`current` refitted on its window (as it is when that fails). A refit that moves the
        model's predictions by more than RATIO_RESET clears the ratio windows named in `clears`
        (TTFT_RATIOS or TBT_RATIOS: those measuring this model) and bumps their side's generation.
        The move is measured over the window's own samples, where the model is used, not at a
        fixed point outside the workload (docs/kvcache_aware.md, "Learning", says why)."""
        fitted = self._refitter.refit(win, current, prior_scale)
        if fitted is None:
            return current
        if clears and self._refitter.moved > self.RATIO_RESET:
            self.ratios.clear(clears)
            if clears == TBT_RATIOS:
                self.tbt_generation += 1
            else:
                self.ttft_generation += 1
        return fitted
