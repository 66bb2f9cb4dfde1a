"""Swings faster than the response: a load that comes back before the workers shed for its lull.

Pure: the time is passed in. The scale-down stabilization window holds the count at the highest
recent recommendation for ``stabilization_window_s``; a load that swings back within a few
minutes (a burst of hard prompts, a curriculum alternating task types) outlasts it, so each lull
sheds workers that the next peak must relaunch, each a model load late. So:

    swing      a scale-up while the trainer starves that reverses a scale-down made less than
               SWING_GAP_S before it
    cycle      the time between two swings (the last CYCLES_KEPT are remembered)
    hold       while swings recur (the last one less than two of its cycles ago), the window
               lengthens to SWING_WINDOW_FACTOR x the longest remembered cycle (at most
               MAX_SWING_WINDOW_S): the count holds at the peaks' level through the lulls

A single reversal teaches nothing (a start-up's sizing step, a lost worker); loads that stop
swinging let the window shrink back two cycles after the last swing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SWING_GAP_S = 120.0  # a starving scale-up this soon after a scale-down reverses it
CYCLES_KEPT = 3
SWING_WINDOW_FACTOR = 1.25
MAX_SWING_WINDOW_S = 900.0


@dataclass
class SwingMemory:
    """The times of the recent swings."""

    at_s: list[float] = field(default_factory=list)

    def scaled_up(self, now_s: float, last_down_s: float, last_up_s: float, starving: bool) -> None:
        """Record a scale-up made now (before ``last_up_s`` moves to it)."""
        if starving and last_down_s > last_up_s and now_s - last_down_s <= SWING_GAP_S:
            self.at_s = [*self.at_s, now_s][-(CYCLES_KEPT + 1):]

    def window_s(self, configured_s: float, now_s: float) -> tuple[float, str]:
        """The scale-down stabilization window to use now, and why when it is longer."""
        cycles = [b - a for a, b in zip(self.at_s, self.at_s[1:], strict=False)]
        if not cycles or now_s - self.at_s[-1] > 2 * cycles[-1]:
            return configured_s, ""
        longest = max(cycles)
        window_s = min(MAX_SWING_WINDOW_S, max(configured_s, SWING_WINDOW_FACTOR * longest))
        if window_s <= configured_s:
            return configured_s, ""
        return window_s, (f"the trainer starved again soon after each of the last {len(self.at_s)} scale-downs "
                          f"(a swing every {longest:.0f} s or less)")

    def to_state(self) -> list[float]:
        return list(self.at_s)

    @classmethod
    def from_state(cls, state: Any) -> SwingMemory:
        """The memory saved by :meth:`to_state`; an empty one for anything else."""
        if not isinstance(state, list):
            return cls()
        return cls([float(t) for t in state if isinstance(t, (int, float))][-(CYCLES_KEPT + 1):])
