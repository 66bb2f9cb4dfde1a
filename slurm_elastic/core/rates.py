"""A rate over a sliding window of timestamped amounts (sequences pulled, accepted, busy seconds).

Pure: the time is passed in. The estimate is the amount that arrived during the observed part of
the window divided by its length:

    rate = Σ amounts in (now - W, now]  /  W                      once the series is older than W
    rate = Σ amounts after the first    /  (now - t_first)        before that

The first event of a series only marks where observing began: counting its amount as well (sum
of every event ÷ time since the first) reads one event too many, ~20 % high at 6 events a minute.
Used by the rollout queue, the controller and the simulator, so all measure the same way; the
windows are the two constants below.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass, field

CONSUMPTION_WINDOW_S = 60.0  # the trainer's pulls
PRODUCTION_WINDOW_S = 120.0  # accepted sequences and busy worker-seconds: a worker's production varies
# with every rollout's length, and 60 s at a few workers holds too few rollouts to steady it


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


def per_worker_rate(production_seqs_per_s: float | None, produced_seqs: float | None,
                    busy_worker_s: float | None, active_workers: int) -> float | None:
    """Sequences per second one worker makes while it generates [seq/s per busy worker].

    ``produced_seqs`` ÷ ``busy_worker_s``: the sequences accepted and the worker-seconds spent
    inside rollouts, both over the last PRODUCTION_WINDOW_S of the clock. Taking both over the
    same span matters while the series are young: busy time is reported from a worker's first
    heartbeat, production only from its first accepted rollout, so a ratio of the two series'
    own rates reads high by the ratio of their ages (several times, in the first minute after a
    long model load). Early on it reads a little low instead: rollouts in flight have busy time
    but no sequences yet. Without busy time (workers that do not report it), production / ACTIVE
    workers, which reads low while workers wait at the staleness gate."""
    if production_seqs_per_s is None:
        return None
    if produced_seqs is not None and busy_worker_s is not None and busy_worker_s > 0:
        return produced_seqs / busy_worker_s
    return production_seqs_per_s / max(1, active_workers)


@dataclass
class TrainerSteps:
    """The trainer's cycle, measured from its pulls and acknowledgements: it waits for a batch
    (from its ask to the batch handed out), then computes (from the batch handed out to its next
    ask: its update, acknowledgement and version publish).

    A step counts only when the batch that began it is acknowledged by its end or during the wait
    that follows (an acknowledgement after the ask ends the step there: the trainer still computed).
    Not measured, neither as compute nor as wait: a step whose batch is still unacknowledged when
    the next one is handed out (a trainer that pulls ahead, or acknowledges several batches at
    once), and a batch handed out again (to a re-registered trainer, which may acknowledge one it
    had already consumed at once). A retried pull is not an ask (the caller does not report it).
    So a pull right after a hand-out never reads as a step of a few milliseconds.

    ``step_s`` is the mean compute time of the last ``keep`` steps; a step in progress that has
    already run longer counts with its time so far, so a slow step (an evaluation pass) shows
    before it ends. ``batch_size`` ÷ it is what the trainer would consume if it never waited: its
    demand, which a starving trainer's consumption (bounded by the supply) cannot show.
    ``wait_fraction`` is the share of the last ``keep`` cycles spent waiting, a wait in progress
    included: what more workers could win back at most."""

    keep: int = 4
    _served_s: float | None = None  # computing since
    _batch: Hashable = None  # the batch the step in progress began with
    _measured: bool = False  # that batch was handed out fresh
    _batch_acked: bool = False
    _asked_s: float | None = None  # waiting since
    _unacked_step: tuple[Hashable, float] | None = None  # (batch, step start): ended by an ask, its ack awaited
    _compute_s: collections.deque[float] = field(default_factory=collections.deque)
    _wait_s: collections.deque[float] = field(default_factory=collections.deque)

    def served(self, now_s: float, batch: Hashable = None, fresh: bool = True) -> None:
        """A batch was handed out (``fresh``: for the first time): the wait, if any, ends and a step begins."""
        if self._asked_s is not None and self._unacked_step is None:
            self._push(self._wait_s, now_s - self._asked_s)
        self._asked_s = self._unacked_step = None
        self._served_s, self._batch, self._measured, self._batch_acked = now_s, batch, fresh, False

    def acked(self, now_s: float, batch: Hashable = None) -> None:
        """A batch was acknowledged: it may end a step its ask left open (the wait begins now)."""
        if self._served_s is not None and batch == self._batch:
            self._batch_acked = True
        elif self._unacked_step is not None and batch == self._unacked_step[0]:
            self._push(self._compute_s, now_s - self._unacked_step[1])
            self._unacked_step = None
            self._asked_s = now_s

    def asked(self, now_s: float) -> None:
        """The trainer asked for a batch (every poll): the step in progress, if any, ends and a wait begins."""
        if self._served_s is not None:
            if self._measured and self._batch_acked:
                self._push(self._compute_s, now_s - self._served_s)
            elif self._measured:
                self._unacked_step = (self._batch, self._served_s)
            self._served_s = None
        if self._asked_s is None:
            self._asked_s = now_s

    def abandon(self) -> None:
        """A new trainer registered: the step or wait in progress was its predecessor's, cut short
        (a killed trainer), and counts as neither."""
        self._served_s = self._asked_s = self._unacked_step = None

    def step_s(self, now_s: float) -> float | None:
        """Seconds of compute per step; None until one step has ended."""
        if not self._compute_s:
            return None
        mean_s = sum(self._compute_s) / len(self._compute_s)
        running_s = 0.0 if self._served_s is None else now_s - self._served_s
        return max(mean_s, running_s)

    def latest_step_s(self, now_s: float) -> float | None:
        """Seconds of the last step, or of the step in progress if it has already run longer; None
        until one step has ended. The speed-up resize reads a fast step here before the mean shows it."""
        if not self._compute_s:
            return None
        running_s = 0.0 if self._served_s is None else now_s - self._served_s
        return max(self._compute_s[-1], running_s)

    def waiting(self) -> bool | None:
        """The trainer is waiting for a batch now (False: it computes; None: it has not asked yet)."""
        if self._asked_s is None and self._served_s is None:
            return None
        return self._asked_s is not None

    def wait_fraction(self, now_s: float) -> float | None:
        """Share of the recent cycles spent waiting for rollouts; None until one step has ended."""
        if not self._compute_s:
            return None
        waiting_s = sum(self._wait_s)
        if self._asked_s is not None and self._unacked_step is None:  # (awaiting an ack: maybe computing)
            waiting_s += now_s - self._asked_s
        computing_s = sum(self._compute_s) + (0.0 if self._served_s is None else now_s - self._served_s)
        return waiting_s / max(1e-9, waiting_s + computing_s)

    def _push(self, recent: collections.deque[float], value_s: float) -> None:
        recent.append(max(0.0, value_s))
        while len(recent) > self.keep:
            recent.popleft()
