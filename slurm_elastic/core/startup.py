"""The autoscaler's start-up: a worker count before the rates it steers by are measured, and the
one sizing step that ends it.

Pure. Until the controller has measured both the trainer's demand (its step time, or its
consumption) and the production of a busy worker, the feed-forward of the control law cannot be
formed. While the buffer is below its setpoint the start-up step then sizes the pool from what
is known:

- both the trainer's demand (measured, or ``batch_size / startup_trainer_step_s``) and a worker's
  production (measured, or ``startup_worker_seqs_per_s``) known: ``ceil(demand / production)``
  workers at once;
- otherwise, while the trainer waits for its first batches, a worker on every GPU the job holds
  (burst jobs not counted). A trainer that waits idles at least a model load and a rollout, and
  only workers launched now shorten that: a count grown by doubling arrives a cooldown late per
  doubling, which with a long model load costs the trainer more than the extra workers cost
  GPU-time before the sizing step. The sizing step sheds them a trainer step later;
- while the trainer computes on its first batches: the count it has;
- before the trainer has asked for anything: twice the current count, once per cooldown,

bounded by what the staleness bound lets generate at once (when a worker's share of the sequences
in flight is measured) and, as every decision is, by min/max workers, the usable GPU slots and
the rollouts the staleness bound lets run at once (:func:`staleness_ceiling`).

Once both rates are measured, one **sizing step** sets ``ceil(demand / production)`` workers at
once, up or down (no votes, stable period or step cap), and the control law takes over.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from slurm_elastic.core.rates import positive
from slurm_elastic.core.staleness import rollouts_at_once

if TYPE_CHECKING:
    from slurm_elastic.core.autoscaler_config import AutoscalerConfig
    from slurm_elastic.core.scaling import PressureInputs


def measured_demand(x: PressureInputs) -> float | None:
    """The trainer's measured demand [seq/s]: from its step time, else its consumption."""
    return positive(x.trainer_demand_seqs_per_s) or positive(x.consumption_seqs_per_s)


def measured(x: PressureInputs) -> bool:
    """Both rates the control law needs are measured."""
    return measured_demand(x) is not None and positive(x.per_worker_seqs_per_s) is not None


def sizing_step(x: PressureInputs) -> tuple[float, str]:
    """The step that ends the start-up: the workers the measured demand needs at the measured
    production (call only when :func:`measured`)."""
    demand, production = measured_demand(x), positive(x.per_worker_seqs_per_s)
    assert demand is not None and production is not None
    rec = float(math.ceil(demand / production - 1e-9))
    return rec, (f"start-up ends: the trainer needs {demand:.2f} seqs/s, a worker makes {production:.2f} "
                 f"(both measured) -> {rec:.0f} workers")


def staleness_room_workers(x: PressureInputs) -> float | None:
    """Workers the staleness bound lets generate at once before the trainer pulls:
    ((max_staleness + 1)·batch_size - queued) ÷ the sequences one active worker holds in flight
    (measured: in flight ÷ active workers); None while that share is not measured."""
    in_flight = positive(x.in_flight_seqs)
    if x.max_staleness is None or in_flight is None or x.workers_active <= 0 or x.queued_seqs is None:
        return None
    room_seqs = (x.max_staleness + 1) * x.batch_size - x.queued_seqs
    return max(1.0, room_seqs / (in_flight / x.workers_active))


def staleness_ceiling(x: PressureInputs) -> int | None:
    """The most workers that can run a rollout at once under the staleness bound, a bound on every
    decision like ``max_workers`` (None: no bound, or no group accepted yet to tell what a rollout
    holds); a worker above it waits at the admission gate and generates nothing."""
    if x.max_staleness is None or not x.smallest_group_seqs or x.batch_size <= 0:
        return None
    held = round((x.in_flight_seqs or 0) + (x.staleness_capacity_seqs or 0))
    return rollouts_at_once(x.max_staleness, x.batch_size, held, x.smallest_group_seqs)


def startup_recommendation(cfg: AutoscalerConfig, x: PressureInputs, current: int,
                           setpoint_seqs: float) -> tuple[float, str] | None:
    """The start-up step's worker count and its reason, or None while the buffer is at or above
    ``setpoint_seqs`` (call only while not :func:`measured`)."""
    queued = x.queued_seqs
    if queued is None or queued >= setpoint_seqs:
        return None
    demand, demand_from = measured_demand(x), "measured"
    if demand is None and cfg.startup_trainer_step_s > 0:
        demand, demand_from = x.batch_size / cfg.startup_trainer_step_s, "startup_trainer_step_s"
    production, production_from = positive(x.per_worker_seqs_per_s), "measured"
    if production is None and cfg.startup_worker_seqs_per_s > 0:
        production, production_from = cfg.startup_worker_seqs_per_s, "startup_worker_seqs_per_s"
    if demand is not None and production is not None:
        rec = float(math.ceil(demand / production - 1e-9))
        why = (f"start-up: the trainer needs {demand:.2f} seqs/s ({demand_from}), a worker makes "
               f"{production:.2f} ({production_from}) -> {rec:.0f} workers")
    elif x.trainer_waiting is False:
        rec = float(current)
        why = "start-up: the trainer computes on its first batches, holding until its demand is measured"
    elif x.trainer_waiting is True:
        held = max(1, x.allowed_slots - x.burst_slots)
        rec = float(max(current, min(cfg.max_workers, held)))  # never fewer before anything is measured
        why = (f"start-up: the trainer waits and its demand is not measured yet, a worker on every GPU the job "
               f"holds -> {rec:.0f} workers until it is")
    else:
        rec = float(max(1, 2 * current))
        why = f"start-up: no trainer has asked for rollouts yet, doubling {current} -> {rec:.0f} workers"
    room = staleness_room_workers(x)
    if room is not None and rec > max(room, current):
        rec = max(math.floor(room), current)
        why += f", held to {rec:.0f} by the staleness room"
    return rec, f"trainer starving: the buffer holds {queued:.0f} of the {setpoint_seqs:.0f} seqs aimed for; {why}"
