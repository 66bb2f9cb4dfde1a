"""The clairvoyant reference: a worker schedule searched over the simulator with the whole trace known.

Pure. The simulator is deterministic for a trace and a seed, so a policy that may replay it knows
every future rollout time, trainer step and failure. :func:`clairvoyant_schedule` builds a
schedule one interval at a time: at each interval's start it copies the simulation and tries
worker counts on the copy, keeping the fewest whose trainer idle over that interval and the next
(``lookahead``) is no more than the maximum count's plus ``slack_fraction`` of that time. It is a
greedy search, not a proven optimum: the physical limit lies at or below the frontier of its
schedules (and of every fixed count, which a clairvoyant could pick as well).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from slurm_elastic.core.scaling import Decision, PressureInputs
from slurm_elastic.sim.engine import Simulation
from slurm_elastic.sim.results import SimResult
from slurm_elastic.sim.trace import Trace


@dataclass
class ScheduledPolicy:
    """A worker count the search sets from outside (the clairvoyant's hand on the controller)."""

    workers: int

    def decide(self, x: PressureInputs, now_s: float) -> Decision:
        current = x.workers_starting + x.workers_active
        action = "hold" if current == self.workers else ("scale_up" if self.workers > current else "scale_down")
        return Decision(self.workers, action, f"clairvoyant schedule: {self.workers} workers")


def _idle_over(base: Simulation, workers: int, until_s: float) -> float:
    """Trainer idle seconds from ``base``'s time to ``until_s`` with ``workers`` from now on."""
    trial = copy.deepcopy(base)
    _set(trial, workers)
    before = trial.trainer_idle_s()
    trial.advance(until_s)
    return trial.trainer_idle_s() - before


def _set(sim: Simulation, workers: int) -> None:
    assert isinstance(sim.policy, ScheduledPolicy)
    sim.policy.workers = workers
    sim.act_now(workers)


def clairvoyant_schedule(trace: Trace, seed: int, interval_s: float = 120.0, slack_fraction: float = 0.0,
                         lookahead: int = 1) -> tuple[list[tuple[float, int]], SimResult]:
    """The schedule [(start_s, workers)] and the run under it (policy name ``clairvoyant``)."""
    top = max(trace.autoscaler.min_workers, min(trace.autoscaler.max_workers, trace.cluster.gpu_slots))
    low = trace.autoscaler.min_workers
    sim = Simulation(trace, "static-max", seed)
    sim.policy_name = f"clairvoyant (slack {slack_fraction:g})"
    sim.policy = ScheduledPolicy(top)
    schedule: list[tuple[float, int]] = []
    start_s = 0.0
    first = True
    while start_s < trace.duration_s:
        end_s = min(trace.duration_s, start_s + interval_s * (1 + lookahead))
        base = copy.deepcopy(sim)
        if first:  # t = 0: launch the chosen count itself
            base.policy = ScheduledPolicy(top)
        allowed = _idle_trial(base, top, end_s, first) + slack_fraction * (end_s - start_s)
        lo, hi = low, top  # the fewest workers within the allowance (idle falls as workers grow)
        while lo < hi:
            mid = (lo + hi) // 2
            if _idle_trial(base, mid, end_s, first) <= allowed + 1e-9:
                hi = mid
            else:
                lo = mid + 1
        schedule.append((start_s, lo))
        if first:
            sim.start(lo)
            sim.policy = ScheduledPolicy(lo)
            first = False
        else:
            _set(sim, lo)
        start_s = min(trace.duration_s, start_s + interval_s)
        sim.advance(start_s)
    return schedule, sim.finish()


def _idle_trial(base: Simulation, workers: int, until_s: float, first: bool) -> float:
    if not first:
        return _idle_over(base, workers, until_s)
    trial = copy.deepcopy(base)
    trial.policy = ScheduledPolicy(workers)
    trial.start(workers)
    trial.advance(until_s)
    return trial.trainer_idle_s()
