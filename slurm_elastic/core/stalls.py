"""Recurring stalls: a trainer that pauses again and again for about as long (an evaluation pass
or a checkpoint every N steps) gets its workers back before the pause ends, a worker's start-up
time ahead, instead of after it.

Pure: the time is passed in. During a stall the trainer's demand falls and the control law
sheds workers; the speed-up resize (core.speedup) brings them back at the trainer's first fast
step, but a relaunched worker loads its model and generates its first rollout while the trainer
waits. So:

    a stall    starts when the trainer's latest step (a step in progress counts as it runs) asks
               for less than STALL_DEMAND_RATIO x its usual demand, and ends at its first step
               back above that; the last STALLS_KEPT durations are remembered
    lead       a new worker's time from launch to its first rollout accepted, measured once at
               the job's start-up (the start-up's launch to the first production measured)
    restore    in a stall, once it has lasted the shortest remembered stall of at least the lead,
               less the lead: the usual count at once (no votes, stable period or step cap)
    hold       after that, no scale-down until the stall ends, or until it has outlasted the
               longest such stall by the lead (then the law decides again)

Stalls shorter than the lead are not counted: no worker shed in one could be back in time, and
a jittery step of a slow phase is one. A trainer's first stall never triggers it; pauses of very
different lengths restore early and hold at most until the longest one seen, plus the lead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

STALL_DEMAND_RATIO = 0.5  # a step asking for less than this share of the usual demand is a stall's
STALLS_KEPT = 3  # durations remembered


@dataclass
class StallMemory:
    """The trainer's recent stalls, the one in progress, and what was done about it."""

    durations_s: list[float] = field(default_factory=list)
    since_s: float | None = None  # the stall in progress began (None: none)
    restored: bool = False  # the count went back to the usual one during this stall

    def observe(self, latest_demand_seqs_per_s: float, usual_demand_seqs_per_s: float, now_s: float) -> None:
        """Start or end a stall on the trainer's latest step."""
        stalled = latest_demand_seqs_per_s < STALL_DEMAND_RATIO * usual_demand_seqs_per_s
        if stalled and self.since_s is None:
            self.since_s, self.restored = now_s, False
        elif not stalled and self.since_s is not None:
            self.durations_s = [*self.durations_s, now_s - self.since_s][-STALLS_KEPT:]
            self.since_s, self.restored = None, False

    def advice(self, now_s: float, lead_s: float | None, usual_workers: float, current: int
               ) -> tuple[int | None, str] | None:
        """(count, why) to go back to the usual count now; (None, why) to hold; None: nothing to say."""
        if self.since_s is None or lead_s is None:
            return None
        durations_s = [d for d in self.durations_s if d >= lead_s]  # shorter ones leave nothing to win
        lasted_s = now_s - self.since_s
        if not durations_s or lasted_s > max(durations_s) + lead_s or lasted_s < min(durations_s) - lead_s:
            return None
        usual = math.ceil(usual_workers - 0.25)
        seen = f"the trainer's last stalls of {lead_s:.0f} s or more lasted {_seconds(durations_s)}"
        if not self.restored and usual > current:
            self.restored = True
            return usual, (f"{seen}; this one has lasted {lasted_s:.0f} s and a new worker takes {lead_s:.0f} s "
                           f"to its first rollout: back to the usual {usual} workers before it ends")
        if self.restored:
            return None, f"hold: workers back for the end of the trainer's stall ({seen}, this one {lasted_s:.0f} s)"
        return None

    def to_state(self) -> dict[str, Any]:
        return {"durations_s": list(self.durations_s), "since_s": self.since_s, "restored": self.restored}

    @classmethod
    def from_state(cls, state: Any) -> StallMemory:
        """The memory saved by :meth:`to_state`; an empty one for anything else."""
        if not isinstance(state, dict):
            return cls()
        durations = [float(d) for d in state.get("durations_s", []) if isinstance(d, (int, float))]
        since = state.get("since_s")
        return cls(durations[-STALLS_KEPT:], float(since) if isinstance(since, (int, float)) else None,
                   bool(state.get("restored", False)))


def _seconds(durations_s: list[float]) -> str:
    return ", ".join(f"{d:.0f}" for d in durations_s) + " s"
