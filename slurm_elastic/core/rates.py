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
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

GROUP_SIZES_KEPT = 64  # the last groups accepted whose sizes GroupSizes keeps
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


def positive(value: float | None) -> float | None:
    """A measured rate as the autoscaler takes it: a positive, finite float, else None (not measured)."""
    return float(value) if value is not None and math.isfinite(value) and value > 0 else None


MIN_STEP_S = 0.05  # a trainer step measured shorter than this is no model update (acks on receipt): not counted


@dataclass
class TrainerSteps:
    """The trainer's compute time per batch and its waits, measured from its calls: it waits from
    an ask (a pull) to the batch handed out, and from an acknowledgement that comes while its ask is
    outstanding (it computed until then); all else is compute.

    The time is cut into windows at the asks that follow an acknowledgement (and at an
    acknowledgement while an ask is outstanding): each window's compute (its length less its
    waits) ÷ the batches acknowledged in it is the compute time per batch. So
    one figure holds however a trainer orders its calls: pull, compute, acknowledge (one batch a
    window); acknowledge after the next pull; pull one ahead in a thread; pull four, update once,
    acknowledge four (a quarter of the update each); acknowledge ten after a checkpoint (a tenth of
    ten steps and the checkpoint each). Batches handed out again (to a re-registered trainer, which
    may acknowledge one it consumed before at once) count as no batch, and a retried pull is no ask
    (the caller does not report it). A window whose compute per batch is under ``MIN_STEP_S`` (a
    thread that acknowledges each batch as it arrives, and so says nothing of its compute) is not
    counted.

    ``step_s`` is the compute per batch over the last ``keep`` windows; a window in progress whose
    compute per batch so far (over the batches it holds or has acknowledged) is already longer
    counts as it runs, so a slow step (an evaluation pass) shows before it ends. ``batch_size`` ÷
    it is what the trainer would consume if it never waited: its demand, which a starving
    trainer's consumption (bounded by the supply) cannot show. ``wait_fraction`` is the share of
    those windows spent waiting, the one in progress included: what more workers could win back."""

    keep: int = 4
    _since_s: float | None = None  # the window in progress began (the last window's end, or the first ask)
    _waited_s: float = 0.0  # its waits that have ended
    _acked: int = 0  # fresh batches acknowledged in it
    _asked_s: float | None = None  # waiting since (an ask outstanding, or an acknowledgement during one)
    _held: dict[Hashable, bool] = field(default_factory=dict)  # handed out, unacknowledged -> fresh
    _windows: collections.deque[tuple[float, float, int]] = field(default_factory=collections.deque)
    # (compute_s, wait_s, batches) of the last ``keep`` counted windows

    def served(self, now_s: float, batch: Hashable = None, fresh: bool = True) -> None:
        """A batch was handed out (``fresh``: for the first time): the wait, if any, ends."""
        if self._since_s is None:
            self._since_s = now_s
        if self._asked_s is not None:
            self._waited_s += now_s - self._asked_s
            self._asked_s = None
        self._held[batch] = fresh

    def acked(self, now_s: float, batch: Hashable = None) -> None:
        """A batch was acknowledged. If an ask is outstanding, the trainer computed until now: its
        wait begins now, and the window ends here."""
        if self._held.pop(batch, False):
            self._acked += 1
        if self._asked_s is not None:
            self._asked_s = max(self._asked_s, now_s)
            self._close(self._asked_s)

    def asked(self, now_s: float) -> None:
        """The trainer asked for a batch (every poll): a wait begins, and a window ends where it
        began if a batch was acknowledged in it."""
        if self._asked_s is None:
            self._asked_s = now_s
        if self._since_s is None:
            self._since_s = now_s
        else:
            self._close(self._asked_s)

    def _close(self, end_s: float) -> None:
        """End the window in progress at ``end_s`` if a batch was acknowledged in it; counted
        unless its compute per batch is under ``MIN_STEP_S``."""
        if not self._acked or self._since_s is None:
            return
        compute_s = end_s - self._since_s - self._waited_s
        if compute_s / self._acked >= MIN_STEP_S:
            self._windows.append((compute_s, self._waited_s, self._acked))
            while len(self._windows) > self.keep:
                self._windows.popleft()
        self._since_s, self._waited_s, self._acked = end_s, 0.0, 0

    def abandon(self) -> None:
        """A new trainer registered: the window in progress was its predecessor's, cut short (a
        killed trainer), and counts as nothing; what it held is handed out again, not fresh."""
        self._since_s, self._asked_s, self._waited_s, self._acked = None, None, 0.0, 0
        self._held.clear()

    def _running(self, now_s: float) -> tuple[float, float, int]:
        """The window in progress: its compute and waits so far, and the batches it covers so far."""
        if self._since_s is None:
            return 0.0, 0.0, 0
        end_s = now_s if self._asked_s is None else self._asked_s
        waiting_s = 0.0 if self._asked_s is None else now_s - self._asked_s
        covers = self._acked + sum(self._held.values())
        return max(0.0, end_s - self._since_s - self._waited_s), self._waited_s + waiting_s, covers

    def step_s(self, now_s: float) -> float | None:
        """Seconds of compute per batch; None until one window has been counted."""
        if not self._windows:
            return None
        mean_s = sum(w[0] for w in self._windows) / sum(w[2] for w in self._windows)
        compute_s, _, covers = self._running(now_s)
        return max(mean_s, compute_s / max(1, covers))

    def latest_step_s(self, now_s: float) -> float | None:
        """Seconds of compute per batch in the last window, or in the one in progress if already
        longer; None until one window has been counted. The speed-up resize reads a fast step here
        before the mean shows it."""
        if not self._windows:
            return None
        compute_s, _, batches = self._windows[-1]
        running_s, _, covers = self._running(now_s)
        return max(compute_s / batches, running_s / max(1, covers))

    def waiting(self) -> bool | None:
        """The trainer is waiting for a batch now (False: it computes; None: it has not asked yet)."""
        if self._since_s is None:
            return None
        return self._asked_s is not None

    def wait_fraction(self, now_s: float) -> float | None:
        """Share of the recent windows spent waiting for rollouts, the one in progress included;
        None until one window has been counted."""
        if not self._windows:
            return None
        compute_s, waiting_s, _ = self._running(now_s)
        waiting_s += sum(w[1] for w in self._windows)
        computing_s = compute_s + sum(w[0] for w in self._windows)
        return waiting_s / max(1e-9, waiting_s + computing_s)


@dataclass
class GroupSizes:
    """The sizes of the last groups accepted [sequences]: the smallest is the least a rollout holds
    of the staleness bound while it runs. Until a group is accepted, the smallest admission asked
    for stands in (a worker asks for its group's sequences before it starts it)."""

    _sizes: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=GROUP_SIZES_KEPT))
    _asked: int | None = None

    def add(self, seqs: int) -> None:
        self._sizes.append(seqs)

    def asked(self, seqs: int) -> None:
        """An admission asked for ``seqs`` (the rest of a group, after a partial grant: smaller)."""
        if seqs > 0 and not self._sizes:
            self._asked = seqs if self._asked is None else min(self._asked, seqs)

    def smallest(self) -> int | None:
        return min(self._sizes) if self._sizes else self._asked
