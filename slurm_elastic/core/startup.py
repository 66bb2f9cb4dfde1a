"""The autoscaler's start-up step: a worker count before the rates it steers by are measured.

Pure. Until the controller has measured both the trainer's consumption and the production of a
busy worker, the feed-forward of the control law cannot be formed. While the buffer is below its
setpoint the start-up step then sizes the pool from what is known:

- both the trainer's demand (``batch_size / startup_trainer_step_s``, or the measured consumption)
  and a worker's production (the measured rate, or ``startup_worker_seqs_per_s``) known:
  ``ceil(demand / production)`` workers at once;
- otherwise twice the current count (a geometric ramp, one doubling per scale-up cooldown),

bounded by what the staleness bound lets generate at once (when a worker's share of the sequences
in flight is measured) and, as every decision is, by min/max workers and the usable GPU slots.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_elastic.core.scaling import AutoscalerConfig, PressureInputs


def _positive(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value > 0 else None


def measured(x: PressureInputs) -> bool:
    """Both rates the control law needs are measured."""
    demand = _positive(x.consumption_seqs_per_s) or _positive(x.trainer_demand_seqs_per_s)
    return demand is not None and _positive(x.per_worker_seqs_per_s) is not None


def staleness_room_workers(x: PressureInputs) -> float | None:
    """Workers the staleness bound lets generate at once before the trainer pulls:
    ((max_staleness + 1)·batch_size - queued) ÷ the sequences one active worker holds in flight
    (measured: in flight ÷ active workers); None while that share is not measured."""
    in_flight = _positive(x.in_flight_seqs)
    if x.max_staleness is None or in_flight is None or x.workers_active <= 0 or x.queued_seqs is None:
        return None
    room_seqs = (x.max_staleness + 1) * x.batch_size - x.queued_seqs
    return max(1.0, room_seqs / (in_flight / x.workers_active))


def startup_recommendation(cfg: AutoscalerConfig, x: PressureInputs, current: int,
                           setpoint_seqs: float) -> tuple[float, str] | None:
    """The start-up step's worker count and its reason, or None once the rates are measured or
    while the buffer is at or above ``setpoint_seqs``."""
    queued = x.queued_seqs
    if measured(x) or queued is None or queued >= setpoint_seqs:
        return None
    demand = _positive(x.consumption_seqs_per_s)
    demand_from = "measured"
    if demand is None and cfg.startup_trainer_step_s > 0:
        demand, demand_from = x.batch_size / cfg.startup_trainer_step_s, "startup_trainer_step_s"
    production = _positive(x.per_worker_seqs_per_s)
    production_from = "measured"
    if production is None and cfg.startup_worker_seqs_per_s > 0:
        production, production_from = cfg.startup_worker_seqs_per_s, "startup_worker_seqs_per_s"
    if demand is not None and production is not None:
        rec = float(math.ceil(demand / production - 1e-9))
        why = (f"start-up: the trainer needs {demand:.2f} seqs/s ({demand_from}), a worker makes "
               f"{production:.2f} ({production_from}) -> {rec:.0f} workers")
    elif x.trainer_waiting is False:
        rec = float(current)
        why = "start-up: the trainer computes on its first batches, holding until its demand is measured"
    else:
        rec = float(max(1, 2 * current))
        unknown = "the trainer's demand" if demand is None else "a worker's production"
        why = f"start-up: {unknown} not measured yet, doubling {current} -> {rec:.0f} workers"
    room = staleness_room_workers(x)
    if room is not None and rec > max(room, current):
        rec = max(math.floor(room), current)
        why += f", held to {rec:.0f} by the staleness room"
    return rec, f"trainer starving: the buffer holds {queued:.0f} of the {setpoint_seqs:.0f} seqs aimed for; {why}"
