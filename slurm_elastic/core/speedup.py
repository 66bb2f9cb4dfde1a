"""The speed-up resize: when the trainer comes back from a stall (a checkpoint, an evaluation
pass), go back in one step to the count it needs, instead of one confirmed step at a time.

Pure: the time is passed in. During a stall the trainer's demand falls and the law scales down;
when its steps are fast again, the votes, stable period and step cap of the law would take
minutes to climb back, each minute idling the trainer. The trigger and the target:

    trigger   the latest step's demand >= SPEEDUP_RATIO x the lower quartile of the demands
              seen over the last SPEEDUP_LOOKBACK_S (one fast step among jittery ones is not
              enough: the quartile sits at the usual jitter, not at its lowest reading)
    target    max(ceil(latest demand / per-worker rate),
                  the usual count, when the latest demand is within SIMILAR_DEMAND of the usual)
    only if   target > current + 1 (smaller gaps are the law's)

The usual count is an average of the worker count over USUAL_TIME_CONSTANT_S, taken only while
the demand is at least half its usual level: a stall does not pull it down, so it remembers how
many workers this trainer's normal pace needed, which the per-worker rate alone, measured over
minutes of stalled production, can misjudge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SPEEDUP_RATIO = 2.0  # the latest demand over the recent lower quartile that counts as a speed-up
SPEEDUP_LOOKBACK_S = 90.0  # how far back the recent demands reach
USUAL_TIME_CONSTANT_S = 300.0  # the usual count and demand average over about this long
SIMILAR_DEMAND = 0.25  # the usual count is a target only within this fraction of the usual demand


@dataclass
class UsualCount:
    """The worker count and the trainer's demand at its normal pace, averaged over time."""

    workers: float
    demand_seqs_per_s: float
    at_s: float

    def observe(self, workers: int, demand_seqs_per_s: float, now_s: float) -> None:
        """Fold in the count now, unless the demand has fallen below half its usual level (a stall)."""
        if demand_seqs_per_s < 0.5 * self.demand_seqs_per_s:
            return
        weight = 1.0 - math.exp(-max(0.0, now_s - self.at_s) / USUAL_TIME_CONSTANT_S)
        self.workers += weight * (workers - self.workers)
        self.demand_seqs_per_s += weight * (demand_seqs_per_s - self.demand_seqs_per_s)
        self.at_s = now_s

    def at_demand(self, demand_seqs_per_s: float) -> float | None:
        """The usual count if ``demand_seqs_per_s`` is close to the usual demand; None otherwise."""
        if abs(demand_seqs_per_s / self.demand_seqs_per_s - 1.0) <= SIMILAR_DEMAND:
            return self.workers
        return None


def lower_quartile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def speedup_resize(latest_demand_seqs_per_s: float, recent_demands: list[float], per_worker_seqs_per_s: float,
                   current: int, usual: UsualCount | None) -> tuple[int, str] | None:
    """The count to jump to, with its reason, when the trainer has just sped up; None otherwise."""
    if not recent_demands or per_worker_seqs_per_s <= 0:
        return None
    before = lower_quartile(recent_demands)
    if latest_demand_seqs_per_s < SPEEDUP_RATIO * before:
        return None
    needed = math.ceil(latest_demand_seqs_per_s / per_worker_seqs_per_s - 1e-9)
    usual_count = usual.at_demand(latest_demand_seqs_per_s) if usual is not None else None
    target = max(needed, math.ceil(usual_count - 0.25) if usual_count is not None else 0)
    if target <= current + 1:
        return None
    remembered = f", {usual_count:.1f} usually at this pace" if usual_count is not None else ""
    return target, (f"the trainer sped up: its last step asks for {latest_demand_seqs_per_s:.2f} seqs/s, "
                    f"{latest_demand_seqs_per_s / before:.1f}x its recent pace; {needed} workers at "
                    f"{per_worker_seqs_per_s:.2f} per worker{remembered}: back to {target} at once")
