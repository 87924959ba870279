"""Running prefills that overran every prediction: evidence, before any of them finishes, that the
prefill model is too fast.

The prefill model learns from finished legs: a refit needs `OnlineConfig.min_samples` of them
(predictors/refit.py). A gateway that starts from a profile of faster hardware (the bundled H800 fit
in front of slower workers) therefore admits and places its first seconds of traffic on predictions
several times too short, and the queues it builds then outlast the refit: in a live capacity run
(benchmarks/bench_live_vs_peers.py --capacity, conversation trace, 2P+2D, workers on another GPU's
profile) the 8th to 23rd requests all missed the TTFT SLO, at every rate, while the refit caught up.

The queue heads tell sooner. The head of a prefill queue has been running `elapsed_s`; however the
engine batches the queue, it cannot take longer than the whole queue's work, so once the head has
run longer than everything queued there was predicted to take, the true model is at least
elapsed / predicted slower. `overrun_scale` is the largest such ratio over a pool's instances, when
it exceeds `slack` (what noise and batching can explain); the decision then predicts prefills that
much slower (`Predictors.prefill_scaled`) until the refit has learned it and the ratio falls back.
It is a lower bound: it never makes a prediction slower than the running prefills have shown.
"""

from __future__ import annotations

from collections.abc import Sequence

from conductor.core.types import InstanceView
from predictors.online import Predictors
from predictors.params import NO_STRETCH

SLACK = 1.5  # a head may run this much longer than its whole queue's prediction before it counts
MIN_OVERRUN_S = 0.05  # and this many seconds longer: a tiny prediction is all fixed costs (HTTP, a step)


def overrun_scale(
    pred: Predictors, instances: Sequence[InstanceView], *, mixed: bool, slack: float = SLACK, min_s: float = MIN_OVERRUN_S
) -> float:
    """The factor the running prefills of `instances` show `pred`'s prefill model to be too fast
    by, at least (1.0: none shows it). `mixed`: the instances are mixed workers, whose prefills the
    streams listed there stretch (Predictors.mixed_stretch), so a head is held to that longer time."""
    scale = 1.0
    for inst in instances:
        queue = inst.prefill_queue
        if not queue or not queue[0].end_seen:  # it may be long over, waiting on its decode's answer
            continue
        s0, s1 = pred.mixed_stretch(inst) if mixed else NO_STRETCH
        predicted = sum(pred.prefill_s(q.new_tokens, q.cached_tokens) + s0 + s1 * q.new_tokens for q in queue)
        elapsed = queue[0].elapsed_s
        if predicted > 0 and elapsed > slack * predicted and elapsed - predicted > min_s:
            scale = max(scale, elapsed / predicted)
    return scale
