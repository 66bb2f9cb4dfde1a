"""A rate over a sliding window of timestamped amounts (sequences pulled, accepted, busy seconds).

Pure: the time is passed in. The estimate is the amount that arrived during the observed part of
the window divided by its length:

    rate = Σ amounts in (now - W, now]  /  W                      once the series is older than W
    rate = Σ amounts after the first    /  (now - t_first)        before that

The first event of a series only marks where observing began: counting its amount as well (sum
of every event ÷ time since the first) reads one event too many, ~20 % high at 6 events a minute.
Used by the rollout queue and by the simulator, so both measure the same way.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class WindowRate:
    window_s: float = 60.0
    min_events: int = 2  # fewer events while the series is younger than the window: no estimate
    _events: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    _first_s: float | None = None  # when the series began (its first event ever, or after a silence)
    _first_amount: float = 0.0

    def add(self, now_s: float, amount: float) -> None:
        self._expire(now_s)
        if self._first_s is None:
            self._first_s, self._first_amount = now_s, amount
        self._events.append((now_s, amount))

    def rate(self, now_s: float) -> float | None:
        """Amount per second over the window; None until there is something to measure."""
        self._expire(now_s)
        if self._first_s is None or not self._events:
            return None
        observed_s = now_s - self._first_s
        if observed_s >= self.window_s:
            return sum(a for _t, a in self._events) / self.window_s
        if len(self._events) < self.min_events:
            return None
        return (sum(a for _t, a in self._events) - self._first_amount) / max(1e-3, observed_s)

    def total(self, now_s: float) -> float:
        """The amount inside the window."""
        self._expire(now_s)
        return sum(a for _t, a in self._events)

    def _expire(self, now_s: float) -> None:
        while self._events and now_s - self._events[0][0] >= self.window_s:  # the window is (now - W, now]
            self._events.popleft()
        if not self._events and self._first_s is not None and now_s - self._first_s > self.window_s:
            self._first_s = None  # a silence longer than the window: the next event starts a new series


def per_worker_rate(production_seqs_per_s: float | None, busy_workers: float | None,
                    active_workers: int) -> float | None:
    """Sequences per second one worker makes while it generates [seq/s per busy worker].

    ``busy_workers`` is the busy worker-seconds reported over the window per second (the mean
    number of workers inside a rollout). Without it (workers that do not report busy time),
    production / ACTIVE workers, which reads low while workers wait at the staleness gate."""
    if production_seqs_per_s is None:
        return None
    if busy_workers is not None and busy_workers > 0:
        return production_seqs_per_s / busy_workers
    return production_seqs_per_s / max(1, active_workers)
