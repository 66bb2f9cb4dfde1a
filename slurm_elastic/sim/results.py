"""What a simulation run yields: the controller's view at each tick, its scale actions, the metrics."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """The controller's view at one tick."""

    t_s: float
    queued_seqs: float
    setpoint_seqs: float
    buffer_capacity_seqs: float
    staleness_capacity_seqs: float
    starting: int
    active: int
    draining: int
    target: int
    action: str
    version: int


@dataclass(frozen=True)
class ScaleEvent:
    t_s: float
    action: str
    before: int
    target: int
    reason: str


@dataclass
class SimResult:
    trace: str
    policy: str
    seed: int
    duration_s: float
    metrics: dict[str, float]
    samples: list[Sample] = field(default_factory=list)
    scale_events: list[ScaleEvent] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"trace": self.trace, "policy": self.policy, "seed": self.seed, "duration_s": self.duration_s,
                "metrics": self.metrics,
                "scale_events": [e.__dict__ for e in self.scale_events]}


def count_reversals(events: list[ScaleEvent], window_s: float) -> int:
    """Scale actions in the opposite direction of the previous one, less than ``window_s`` after it."""
    reversals = 0
    for before, after in itertools.pairwise(events):
        if before.action != after.action and after.t_s - before.t_s < window_s:
            reversals += 1
    return reversals


def run_metrics(counters: Mapping[str, float], end_s: float, max_staleness: int, buffered_seqs: int,
                reversals: int, scale_actions: int) -> dict[str, float]:
    """A run's metrics from its counters at its end (``end_s``)."""
    c = counters
    return {
        "trainer_idle_fraction": c["trainer_idle_s"] / end_s,
        "gpu_seconds": c["gpu_s"],
        "mean_workers": c["gpu_s"] / end_s,
        "max_staleness": float(max_staleness),
        "scale_actions": float(scale_actions),
        "reversals": float(reversals),
        "trainer_steps": float(c["steps"]),
        "generated_seqs": float(c["generated"]),
        "consumed_seqs": float(c["consumed"]),
        "dropped_stale_seqs": float(c["dropped"]),
        "buffered_seqs": float(buffered_seqs),
        "lost_in_flight_seqs": float(c["lost"]),
        "worker_failures": float(c["failures"]),
        "launches": float(c["launches"]),
    }
