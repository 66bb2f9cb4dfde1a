"""How many rollouts may start now without breaking the staleness bound (AReaL's semantics).

    capacity = min(max_concurrent - running,
                   (max_staleness + version + 1) * batch_size - (accepted + running))

``version`` is the trainer's policy version; ``accepted`` counts rollouts accepted into the
buffer since the count was last anchored, ``running`` those admitted and not yet finished. After
the trainer resumes from a checkpoint at version V, ``on_version_recovered(V)`` anchors
``accepted`` at V * batch_size, so the capacity is (max_staleness + 1) * batch_size - running,
not inflated by V (the bug AReaL fixed after recovery). Counts are in sequences.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StalenessManager:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    version: int = 0
    accepted: int = 0
    running: int = 0
    rejected: int = 0
    submitted: int = 0

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or self.max_staleness < 0 or self.max_concurrent <= 0:
            raise ValueError("batch_size and max_concurrent must be > 0 and max_staleness >= 0")

    def capacity(self) -> int:
        """Rollouts (sequences) that may start now; never negative."""
        concurrency = self.max_concurrent - self.running
        staleness = (self.max_staleness + self.version + 1) * self.batch_size - (self.accepted + self.running)
        return max(0, min(concurrency, staleness))

    def on_submitted(self, n: int = 1) -> None:
        """n rollouts were admitted and started."""
        self.submitted += n
        self.running += n

    def on_accepted(self, n: int = 1) -> None:
        """n running rollouts finished and were accepted into the buffer."""
        self.running = max(0, self.running - n)
        self.accepted += n

    def on_rejected(self, n: int = 1) -> None:
        """n running rollouts finished but were not accepted (dropped, failed, too stale)."""
        self.running = max(0, self.running - n)
        self.rejected += n

    def on_dropped(self, n: int = 1) -> None:
        """n accepted rollouts were dropped from the buffer (too stale): they will never be consumed."""
        self.accepted = max(0, self.accepted - n)
        self.rejected += n

    def on_version(self, version: int) -> None:
        """The trainer published a new policy version."""
        self.version = max(self.version, version)

    def on_version_recovered(self, version: int) -> None:
        """The trainer resumed from a checkpoint at ``version``: anchor the accepted count to it."""
        self.version = version
        self.accepted = version * self.batch_size

    def to_state(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StalenessManager:
        return cls(**{k: int(v) for k, v in state.items() if k in cls.__dataclass_fields__})


@dataclass
class AdmissionGrants:
    """Admissions handed out and not yet used by a submit. One a worker never uses (it drained or
    crashed) stops holding staleness capacity after ``ttl_s``. Used by the queue and the simulator."""

    staleness: StalenessManager
    ttl_s: float
    _open: collections.deque[list[float]] = field(default_factory=collections.deque)  # [granted at, unused]

    def grant(self, wanted: int, now_s: float) -> int:
        """How many of ``wanted`` sequences may start now; those are counted as running."""
        self.expire(now_s)
        granted = max(0, min(wanted, self.staleness.capacity()))
        if granted:
            self.staleness.on_submitted(granted)
            self._open.append([now_s, float(granted)])
        return granted

    def use(self, n_seqs: int) -> None:
        """A submit of ``n_seqs`` used the oldest open admissions."""
        while n_seqs > 0 and self._open:
            take = min(n_seqs, int(self._open[0][1]))
            self._open[0][1] -= take
            n_seqs -= take
            if self._open[0][1] <= 0:
                self._open.popleft()

    def expire(self, now_s: float) -> None:
        while self._open and now_s - self._open[0][0] > self.ttl_s:
            _t, unused = self._open.popleft()
            self.staleness.on_rejected(int(unused))
