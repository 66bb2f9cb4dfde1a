"""What the autoscaler remembers between its decisions, and how the state file keeps it (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slurm_elastic.core.autoscaler_config import AutoscalerConfig
from slurm_elastic.core.rates import positive
from slurm_elastic.core.speedup import UsualCount
from slurm_elastic.core.stalls import StallMemory
from slurm_elastic.core.swings import SwingMemory

_Memory = TypeVar("_Memory", bound="AutoscalerMemory")


@dataclass
class AutoscalerMemory:
    """The autoscaler's knobs and memory (integral, votes, cooldowns, window); the policy itself is
    :class:`slurm_elastic.core.scaling.Autoscaler`."""

    config: AutoscalerConfig
    integral: float = 0.0
    last_queued: float | None = None
    last_now_s: float | None = None
    votes_dir: int = 0
    votes: int = 0
    direction_since_s: float | None = None
    last_up_s: float = -math.inf
    last_down_s: float = -math.inf
    window: list[tuple[float, float, float | None]] = field(default_factory=list)  # (time, recommendation, demand)
    held_dir: int = 0  # +1/-1: the last decision held back a move that way (conditional integration)
    startup_step: bool = False  # this decision is the start-up step (no votes, stable period or step cap)
    ramped: bool = False  # both rates were measured: the start-up is over for this job (kept across restarts)
    starting: bool = False  # the start-up decided, and its sizing step is still to come
    direct_step: bool = False  # this decision is a speed-up resize (no votes, stable period or step cap)
    usual: UsualCount | None = None  # the count at the trainer's normal pace (core.speedup)
    stalls: StallMemory = field(default_factory=StallMemory)  # the trainer's recurring stalls (core.stalls)
    swings: SwingMemory = field(default_factory=SwingMemory)  # scale-downs the load soon undid (core.swings)
    lead_s: float | None = None  # a new worker's launch to its first rollout, measured at the start-up
    first_seen_s: float | None = None  # the first decision of a job's start-up (None: not seen)
    resumed_s: float | None = None  # restored by a restarted controller: its first tick (holds RESUME_SETTLE_S)
    resuming: bool = False  # restored, and its rates not yet measured for RESUME_SETTLE_S (not saved)
    returning: bool = False  # back from ticks it did not decide in: its next law decision may resize (not saved)

    def skip_integration(self) -> None:
        """The time until the next decision is not integrated over (the job was suspended, or the
        autoscaler did not decide meanwhile)."""
        self.last_now_s = None

    def not_deciding(self, now_s: float) -> None:
        """The autoscaler did not decide this tick (an operator's target, a pause, wake-all, the
        drain before the time limit): the time until it decides again is not integrated over, and
        a restarted controller's settling time runs from its first tick. The next decision of the
        law, once the rates are measured, may size the pool to the trainer's demand at once
        (:func:`slurm_elastic.core.scaling.return_resize`): also when the count was taken before the
        start-up sized the pool (`scale J 99` while the job started, then `scale J 0`, `resume`: the
        start-up's sizing step never came and the law climbed 1 -> 2 in 40 s, the trainer waiting
        90% of its steps; an operator's probe of a live job). A start-up that runs still ends with
        its own sizing step first."""
        self.skip_integration()
        self.returning = True
        if self.resuming and self.resumed_s is None:
            self.resumed_s = now_s

    def to_state(self) -> dict[str, Any]:
        return {"integral": self.integral, "last_queued": self.last_queued,
                "votes_dir": self.votes_dir, "votes": self.votes, "direction_since_s": self.direction_since_s,
                "last_up_s": None if math.isinf(self.last_up_s) else self.last_up_s,
                "last_down_s": None if math.isinf(self.last_down_s) else self.last_down_s,
                "window": [list(w) for w in self.window], "held_dir": self.held_dir, "ramped": self.ramped,
                "starting": self.starting,
                "usual": None if self.usual is None else [self.usual.workers, self.usual.demand_seqs_per_s,
                                                          self.usual.at_s],
                "stalls": self.stalls.to_state(), "swings": self.swings.to_state(), "lead_s": self.lead_s,
                "first_seen_s": self.first_seen_s}

    @classmethod
    def from_state(cls: type[_Memory], config: AutoscalerConfig, state: Mapping[str, Any]) -> _Memory:
        scaler = cls(config)
        scaler.integral = float(state.get("integral", 0.0))
        scaler.last_queued = state.get("last_queued")
        # last_now_s stays None: a restarted controller does not integrate over the time it was down
        scaler.votes_dir = int(state.get("votes_dir", 0))
        scaler.votes = int(state.get("votes", 0))
        scaler.direction_since_s = state.get("direction_since_s")
        up, down = state.get("last_up_s"), state.get("last_down_s")
        scaler.last_up_s = -math.inf if up is None else float(up)
        scaler.last_down_s = -math.inf if down is None else float(down)
        scaler.window = [(float(w[0]), float(w[1]), positive(w[2]) if len(w) > 2 else None)
                         for w in state.get("window", [])]
        scaler.held_dir = int(state.get("held_dir", 0))
        scaler.ramped = bool(state.get("ramped", True))  # saved before the ramp existed: a running job
        scaler.starting = bool(state.get("starting", False))
        usual = state.get("usual")
        scaler.usual = None if usual is None else UsualCount(float(usual[0]), float(usual[1]), float(usual[2]))
        scaler.stalls = StallMemory.from_state(state.get("stalls"))
        scaler.swings = SwingMemory.from_state(state.get("swings"))
        lead = state.get("lead_s")
        scaler.lead_s = float(lead) if isinstance(lead, (int, float)) and lead > 0 else None
        first = state.get("first_seen_s")
        scaler.first_seen_s = float(first) if isinstance(first, (int, float)) and math.isfinite(first) else None
        scaler.resuming = True
        return scaler
